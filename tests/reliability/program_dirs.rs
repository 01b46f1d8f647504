//! Program dirs from `xtrain compile`: their flags are fixed, an edited manifest is refused, a form
//! this plugin cannot run is named.

use super::*;

#[test]
fn a_program_dir_fixes_its_flags() {
    let dir = tempdir("rel-program-flags");
    let model = fixtures().join("model");
    let prog = dir.join("prog");
    let o = xtrain(&[
        "compile",
        "--model",
        model.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--lora-r",
        "4",
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr_of(&o));
    // --lora-r 8 against a program built for r=4: refused, naming both.
    let mut a = train_on(
        &model,
        &dir.join("a"),
        &["--program", prog.to_str().unwrap()],
    );
    let r = a.iter().position(|s| s == "--lora-r").unwrap();
    a[r + 1] = "8".into();
    let e = fails(&refs(&a));
    assert!(
        e.contains("was built with --lora-r 4, but the command line gives --lora-r 8"),
        "{e}"
    );
    // A form of the program other than its own: refused too (left out, the flag takes what
    // the program has).
    let mut b = a.clone();
    b[r + 1] = "4".into();
    b.extend(["--keep-softmax-stats".into(), "true".into()]);
    let e = fails(&refs(&b));
    assert!(
        e.contains(
            "was built with --keep-softmax-stats false, but the command line gives --keep-softmax-stats true"
        ),
        "{e}"
    );
    // A remat policy other than the program's (layer: `auto` is layer where the memory is not
    // known) is refused too; `--remat auto` takes the program's.
    let mut c = a.clone();
    c[r + 1] = "4".into();
    c.extend(["--remat".into(), "save-proj".into()]);
    let e = fails(&refs(&c));
    assert!(
        e.contains("was built with --remat layer, but the command line gives --remat save-proj"),
        "{e}"
    );
    // Left out, the rank is the program's.
    a.drain(r..r + 2);
    let o = xtrain(&refs(&a));
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert_eq!(adapter_rank(&dir.join("a/adapter")), 4);
    // Compiling into it again needs --overwrite.
    let e = fails(&[
        "compile",
        "--model",
        model.to_str().unwrap(),
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(e.contains("is not empty"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An edited manifest (here another LoRA alpha, which the program text has built in) is refused
/// naming what was edited, rather than trained with the text's alpha and recorded with the
/// manifest's; so is a program dir of another manifest format.
#[test]
fn an_edited_manifest_is_refused() {
    let dir = tempdir("rel-edited-manifest");
    let prog = program_dir(&dir, &[]);
    let model = fixtures().join("model");
    let path = prog.join("manifest.json");
    let original = std::fs::read_to_string(&path).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&original).unwrap();
    assert_eq!(m["spec"]["lora"]["alpha"].as_f64(), Some(32.0));
    m["spec"]["lora"]["alpha"] = 8.0.into();
    std::fs::write(&path, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    let out = dir.join("run");
    let e = fails(&refs(&train_on(
        &model,
        &out,
        &["--program", prog.to_str().unwrap()],
    )));
    assert!(
        e.contains("manifest.json was edited after `xtrain compile` wrote it")
            && e.contains("Compile again"),
        "{e}"
    );
    assert!(!out.join("adapter").exists());
    // The manifest as written trains.
    std::fs::write(&path, &original).unwrap();
    let o = xtrain(&refs(&train_on(
        &model,
        &out,
        &["--program", prog.to_str().unwrap()],
    )));
    assert!(o.status.success(), "{}", stderr_of(&o));
    // A manifest of the first format (one build, no settings hash).
    let mut old: serde_json::Value = serde_json::from_str(&original).unwrap();
    old["format"] = "xtrain-program/1".into();
    std::fs::write(&path, old.to_string()).unwrap();
    let e = fails(&refs(&train_on(
        &model,
        &dir.join("run2"),
        &["--program", prog.to_str().unwrap()],
    )));
    assert!(
        e.contains("format xtrain-program/1 is not xtrain-program/2")
            && e.contains("compile the program dir again"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A GPU program dir that keeps values in host memory, trained on the CPU, is refused by name
/// before XLA sees it (which said only "UNIMPLEMENTED: Side-effect ops cannot be replicated");
/// the same for `train --offload` and `compile --check --offload` on the CPU.
#[test]
fn an_offloaded_program_dir_is_refused_on_the_cpu_by_name() {
    let dir = tempdir("rel-offload-cpu");
    let prog = program_dir(&dir, &["--mesh", "fsdp=2", "--offload", "activations"]);
    let model = fixtures().join("model");
    let want = "keeps values in host memory (--offload activations), but XLA's CPU compiler cannot place values in host memory";
    // (after the line that says which flags the program dir fixed)
    let o = xtrain(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--program", prog.to_str().unwrap()],
    )));
    let e = stderr_of(&o);
    assert!(!o.status.success() && !e.contains("panicked"), "{e}");
    assert!(
        e.contains(&format!("error: program dir {}", prog.display()))
            && e.contains(want)
            && e.contains("--offload none"),
        "{e}"
    );
    assert!(!e.contains("Side-effect"), "{e}");
    let e = fails(&refs(&train_on(
        &model,
        &dir.join("run2"),
        &["--offload", "activations"],
    )));
    assert!(e.contains(want), "{e}");
    let e = fails(&[
        "compile",
        "--model",
        model.to_str().unwrap(),
        "--offload",
        "activations",
        "--check",
        "--out",
        dir.join("p2").to_str().unwrap(),
    ]);
    assert!(e.contains(want), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_recipe_value_that_contradicts_a_program_dir_is_named_as_the_recipes() {
    let dir = tempdir("rel-recipe-source");
    let model = fixtures().join("model");
    let prog = dir.join("prog");
    let o = xtrain(&[
        "compile",
        "--model",
        model.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--lora-r",
        "4",
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr_of(&o));
    let recipe = dir.join("r.toml");
    std::fs::write(&recipe, "lora_alpha = 64\n").unwrap();
    let mut args = train_on(
        &model,
        &dir.join("run"),
        &["--program", prog.to_str().unwrap()],
    );
    args.extend(["--config".to_string(), recipe.to_str().unwrap().to_string()]);
    let e = fails(&refs(&args));
    assert!(
        e.contains(&format!(
            "was built with --lora-alpha 32, but the recipe {} gives --lora-alpha 64",
            recipe.display()
        )),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn train_with_a_program_dir_says_which_remat_and_offload_it_took() {
    let dir = tempdir("rel-program-remat");
    let model = fixtures().join("model");
    let prog = dir.join("prog");
    let o = xtrain(&[
        "compile",
        "--model",
        model.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--lora-r",
        "4",
        "--remat",
        "save-proj",
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr_of(&o));
    let o = xtrain(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--program", prog.to_str().unwrap()],
    )));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "program dir {}: --remat save-proj, --offload none (as it was compiled)",
            prog.display()
        )),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
