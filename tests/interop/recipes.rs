//! TOML recipes: their keys are the flags, the command line overrides them, a wrong key or
//! value is named with its file, and every file in recipes/ compiles.

use super::*;

fn manifest(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap()
}

/// `dir/r.toml`: the tiny model's recipe, with a train key (`lr`) and a [compile] section.
fn recipe_with_a_compile_section(dir: &Path) -> PathBuf {
    let recipe = dir.join("r.toml");
    std::fs::write(
        &recipe,
        "model = \"tiny-llama3\"\nlora-r = 8\nlora_targets = [\"q\", \"v\"]\nseq = 32\nbatch_size = 2\nlr = 1e-4\n[compile]\nbatch = 4\n",
    )
    .unwrap();
    recipe
}

/// `compile --config RECIPE --out OUT EXTRA`.
fn compile_recipe(recipe: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["compile", "--config", recipe.to_str().unwrap(), "--out"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.push(out.display().to_string());
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

// ---------------------------------------------------------------------------------------------
// Keys as flags

#[test]
fn a_recipe_trains_a_repo_id_on_parquet_with_the_command_line_overriding_it() {
    let dir = tempdir("interop-run");
    let out = recipe_run_on_a_repo_id_and_parquet(&dir);
    let (steps, evals) = steps_and_evals(&out);
    assert_eq!(
        steps.len(),
        3,
        "the command line's --steps won: {steps:?} {evals:?}"
    );
    assert_eq!(evals.len(), 3, "steps 0, 2 and 3: {steps:?} {evals:?}");
    let adapter: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(adapter["r"], 4);
    assert_eq!(
        adapter["base_model_name_or_path"], "org/tiny",
        "the adapter names the repo, not the snapshot path"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn compile_leaves_out_a_recipes_train_keys_and_says_so() {
    let dir = tempdir("recipe-keys-unused");
    let recipe = recipe_with_a_compile_section(&dir);
    let o = xtrain(&refs(&compile_recipe(&recipe, &dir.join("prog"), &[])));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("not used by `xtrain compile`: lr"),
        "train's keys are left out, and said so"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_recipes_compile_section_overrides_its_top_level() {
    let dir = tempdir("recipe-keys-section");
    let recipe = recipe_with_a_compile_section(&dir);
    let out = dir.join("prog");
    let o = xtrain(&refs(&compile_recipe(&recipe, &out, &[])));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let spec = manifest(&out).to_string();
    assert!(
        spec.contains("\"seq\":32") && spec.contains("\"batch\":4"),
        "[compile] overrides the top level: {spec}"
    );
    assert!(spec.contains("\"r\":8"), "{spec}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn flags_override_a_recipes_keys() {
    let dir = tempdir("recipe-keys-flags");
    let recipe = recipe_with_a_compile_section(&dir);
    let out = dir.join("prog");
    let o = xtrain(&refs(&compile_recipe(
        &recipe,
        &out,
        &["--lora-r", "2", "--seq", "16"],
    )));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let spec = manifest(&out).to_string();
    assert!(
        spec.contains("\"r\":2") && spec.contains("\"seq\":16"),
        "flags override: {spec}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Wrong keys and values

/// `compile --config` of a recipe holding `text` is refused saying `want` and naming the file,
/// for each of `cases`.
fn recipe_is_refused(name: &str, cases: &[(&str, &str)]) {
    let dir = tempdir(name);
    let recipe = dir.join("r.toml");
    for (text, want) in cases {
        std::fs::write(&recipe, text).unwrap();
        let err = fails(&refs(&compile_recipe(
            &recipe,
            &dir.join("prog"),
            &["--model", "tiny-llama3"],
        )));
        assert!(err.contains(want), "{text:?}: {err}");
        assert!(
            err.contains(recipe.to_str().unwrap()),
            "names the file: {err}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_recipe_key_that_is_not_a_flag_names_the_nearest_one() {
    recipe_is_refused(
        "recipe-keys-nearest",
        &[
            ("learning_rate = 1e-4\n", "key `learning_rate` is not a flag of `xtrain train` or `xtrain compile`; the nearest flag is --lr"),
            ("lora_rnak = 4\n", "the nearest flag is --lora-r"),
        ],
    );
}

#[test]
fn a_train_key_in_a_recipes_compile_section_is_refused() {
    recipe_is_refused(
        "recipe-keys-compile-section",
        &[(
            "[compile]\nepochs = 2\n",
            "key `epochs` in [compile] is a `train` key (a flag of `xtrain train`, not of `xtrain compile`): put it under [train]",
        )],
    );
}

#[test]
fn an_unknown_recipe_section_is_refused() {
    recipe_is_refused(
        "recipe-keys-section-unknown",
        &[("[serve]\nport = 1\n", "[serve] is not a section")],
    );
}

#[test]
fn a_recipe_value_of_the_wrong_kind_is_refused_saying_what_the_flag_takes() {
    recipe_is_refused(
        "recipe-keys-value-kind",
        &[
            (
                "check = \"yes\"\n",
                "`check` is a switch (--check): write true or false, not a string",
            ),
            ("seq = [[1]]\n", "`seq` (--seq) takes a value, not an array"),
        ],
    );
}

#[test]
fn a_recipe_that_is_not_valid_toml_is_refused() {
    recipe_is_refused("recipe-keys-not-toml", &[("seq = \n", "is not valid TOML")]);
}

#[test]
fn a_recipe_key_config_is_refused_by_compile() {
    recipe_is_refused(
        "recipe-keys-config",
        &[(
            "config = \"other.toml\"\n",
            "`config` cannot be a recipe key",
        )],
    );
}

#[test]
fn a_recipe_that_cannot_be_read_is_refused_naming_it() {
    let err = fails(&[
        "compile",
        "--config",
        "/nonexistent/r.toml",
        "--model",
        "x",
        "--out",
        "y",
    ]);
    assert!(err.contains("cannot read /nonexistent/r.toml"), "{err}");
}

/// `config` and `help` in a recipe (at the top or in a section) are refused as what they are,
/// not a recipe's settings; they were taken for misspelt flags ("the nearest flag is --out").
#[test]
fn a_recipe_key_config_or_help_is_said_not_to_be_a_setting() {
    let dir = tempdir("recipe-config-key");
    let recipe = dir.join("r.toml");
    for (text, want) in [
        (
            "config = \"base.toml\"\n",
            "`config` cannot be a recipe key: --config names the recipe file itself (a recipe cannot include another)",
        ),
        (
            "[train]\nhelp = true\n",
            "`help` cannot be a recipe key: --help prints the command's flags and runs nothing",
        ),
    ] {
        std::fs::write(&recipe, text).unwrap();
        let err = fails(&[
            "train",
            "--config",
            recipe.to_str().unwrap(),
            "--model",
            "x",
            "--data",
            "d.jsonl",
            "--out",
            dir.join("run").to_str().unwrap(),
        ]);
        assert!(err.contains(&format!("{}: {want}", recipe.display())), "{text:?}: {err}");
        assert!(!err.contains("nearest flag"), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// recipes/

#[test]
fn every_recipe_compiles_without_weights() {
    let dir = tempdir("recipes");
    let recipes = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes");
    let mut names: Vec<PathBuf> = std::fs::read_dir(&recipes)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    names.sort();
    assert!(names.len() >= 6, "{names:?}");
    // The recipes' --target plugins are fetched on first use; ROCm's needs its runtime's stand-ins.
    let rocm_libs = rocm_standins_in("recipes-rocm");
    for r in names {
        let out = dir.join(r.file_stem().unwrap());
        // An empty hub cache and no downloads: the recipes' models are presets' repos.
        let o = xtrain_cmd()
            .args(["compile", "--config"])
            .arg(&r)
            .arg("--out")
            .arg(&out)
            .env("HF_HUB_CACHE", dir.join("empty-hub"))
            .env("HF_HUB_OFFLINE", "1")
            .env("LD_LIBRARY_PATH", &rocm_libs)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{}: {stdout}{}",
            r.display(),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(out.join("train_step.mlir").is_file(), "{}", r.display());
        // A recipe for hardware names it as its --target, and compiles for it.
        let recipe = std::fs::read_to_string(&r).unwrap();
        if let Some(line) = recipe.lines().find(|l| l.starts_with("target = ")) {
            let target = line.trim_start_matches("target = ").trim_matches('"');
            assert!(
                stdout.contains(&format!("target {target}: ")),
                "{}: {stdout}",
                r.display()
            );
        }
    }
    std::fs::remove_dir_all(&rocm_libs).unwrap();
}
