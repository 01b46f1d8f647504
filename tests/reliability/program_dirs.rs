//! Program dirs from `xtrain compile`: their flags are fixed, one built for another model or
//! edited (its program or its manifest) is refused, a form this plugin cannot run is named.

use super::*;

#[test]
fn train_with_a_program_dir_refuses_another_lora_r_naming_both() {
    let dir = tempdir("rel-program-lora-r");
    let prog = program_dir(&dir, &[]);
    // --lora-r 8 against a program built for r=4.
    let mut a = train_on(
        &fixtures().join("model"),
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
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A form of the program other than its own is refused too (left out, the flag takes what the
/// program has).
#[test]
fn train_with_a_program_dir_refuses_another_form_of_its_program() {
    let dir = tempdir("rel-program-form");
    let prog = program_dir(&dir, &[]);
    let e = fails(&refs(&train_on(
        &fixtures().join("model"),
        &dir.join("a"),
        &[
            "--program",
            prog.to_str().unwrap(),
            "--keep-softmax-stats",
            "true",
        ],
    )));
    assert!(
        e.contains(
            "was built with --keep-softmax-stats false, but the command line gives --keep-softmax-stats true"
        ),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A remat policy other than the program's (layer: `auto` is layer where the memory is not
/// known) is refused too; `--remat auto` takes the program's.
#[test]
fn train_with_a_program_dir_refuses_another_remat_policy() {
    let dir = tempdir("rel-program-remat-other");
    let prog = program_dir(&dir, &[]);
    let e = fails(&refs(&train_on(
        &fixtures().join("model"),
        &dir.join("a"),
        &["--program", prog.to_str().unwrap(), "--remat", "save-proj"],
    )));
    assert!(
        e.contains("was built with --remat layer, but the command line gives --remat save-proj"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn train_with_a_program_dir_takes_its_rank_when_lora_r_is_left_out() {
    let dir = tempdir("rel-program-rank");
    let prog = program_dir(&dir, &[]);
    let mut a = train_on(
        &fixtures().join("model"),
        &dir.join("a"),
        &["--program", prog.to_str().unwrap()],
    );
    let r = a.iter().position(|s| s == "--lora-r").unwrap();
    a.drain(r..r + 2);
    let o = xtrain(&refs(&a));
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert_eq!(adapter_rank(&dir.join("a/adapter")), 4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn compiling_into_a_program_dir_again_needs_overwrite() {
    let dir = tempdir("rel-program-again");
    let prog = program_dir(&dir, &[]);
    let e = fails(&[
        "compile",
        "--model",
        fixtures().join("model").to_str().unwrap(),
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(e.contains("is not empty"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_program_dir_built_for_another_model_is_refused() {
    let dir = tempdir("rel-program-other-model");
    let prog = dir.join("prog");
    let o = xtrain(&[
        "compile",
        "--model",
        "llama-3.1-8b",
        "--seq",
        "16",
        "--batch",
        "2",
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let e = fails(&refs(&train_on(
        &fixtures().join("model"),
        &dir.join("out"),
        &["--program", prog.to_str().unwrap()],
    )));
    assert!(e.contains("was built for another model"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A program dir whose program text was changed after `xtrain compile` wrote it (here one that
/// would otherwise train: built for this model and these flags).
#[test]
fn a_program_dir_whose_program_was_edited_is_refused() {
    let dir = tempdir("rel-program-tampered");
    let prog = program_dir(&dir, &[]);
    std::fs::write(prog.join("train_step.mlir"), "module {}").unwrap();
    let e = fails(&refs(&train_on(
        &fixtures().join("model"),
        &dir.join("out"),
        &["--program", prog.to_str().unwrap()],
    )));
    assert!(e.contains("does not match its manifest"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An edited manifest (here another LoRA alpha, which the program text has built in) is refused
/// naming what was edited, rather than trained with the text's alpha and recorded with the
/// manifest's.
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
    // The command it suggests, with the settings' flags, compiles the dir again (it suggested
    // `xtrain compile --out DIR`, which is refused: no --model, and DIR is not empty), and the
    // program dir it writes trains.
    let suggested = e
        .split("Compile again with the settings you want: `")
        .nth(1)
        .and_then(|rest| rest.split('`').next())
        .unwrap_or_else(|| panic!("no command suggested: {e}"));
    let suggested = suggested.replacen("xtrain", env!("CARGO_BIN_EXE_xtrain"), 1);
    let o = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{suggested} --batch 2 --seq 16 --lora-r 4"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{suggested}: {}", stderr_of(&o));
    let o = xtrain(&refs(&train_on(
        &model,
        &out,
        &["--program", prog.to_str().unwrap()],
    )));
    assert!(o.status.success(), "{}", stderr_of(&o));
    std::fs::remove_dir_all(&out).unwrap();
    // The control that belongs with it: the manifest as written trains (the edit was refused).
    std::fs::write(&path, &original).unwrap();
    let o = xtrain(&refs(&train_on(
        &model,
        &out,
        &["--program", prog.to_str().unwrap()],
    )));
    assert!(o.status.success(), "{}", stderr_of(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A manifest of the first format (one build, no settings hash).
#[test]
fn a_program_dir_of_an_older_manifest_format_is_refused() {
    let dir = tempdir("rel-old-manifest");
    let prog = program_dir(&dir, &[]);
    let path = prog.join("manifest.json");
    let mut old: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    old["format"] = "xtrain-program/1".into();
    std::fs::write(&path, old.to_string()).unwrap();
    let e = fails(&refs(&train_on(
        &fixtures().join("model"),
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

/// What the CPU plugin says of a program dir (or a run) that keeps values in host memory.
const OFFLOAD_ON_THE_CPU: &str = "keeps values in host memory (--offload activations), but XLA's CPU compiler cannot place values in host memory";

/// A GPU program dir that keeps values in host memory, trained on the CPU, is refused by name
/// before XLA sees it (which said only "UNIMPLEMENTED: Side-effect ops cannot be replicated").
#[test]
fn an_offloaded_program_dir_is_refused_on_the_cpu_by_name() {
    let dir = tempdir("rel-offload-cpu");
    let prog = program_dir(&dir, &["--mesh", "fsdp=2", "--offload", "activations"]);
    // (after the line that says which flags the program dir fixed)
    let o = xtrain(&refs(&train_on(
        &fixtures().join("model"),
        &dir.join("run"),
        &["--program", prog.to_str().unwrap()],
    )));
    let e = stderr_of(&o);
    assert!(!o.status.success() && !e.contains("panicked"), "{e}");
    assert!(
        e.contains(&format!("error: program dir {}", prog.display()))
            && e.contains(OFFLOAD_ON_THE_CPU)
            && e.contains("--offload none"),
        "{e}"
    );
    assert!(!e.contains("Side-effect"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The same check as a program dir's, for `--offload` typed: by `train` and by
/// `compile --check` on the CPU alike.
#[test]
fn offload_on_the_cpu_is_refused_by_name_by_train_and_compile_check() {
    let dir = tempdir("rel-offload-cpu-flag");
    let model = fixtures().join("model");
    let e = fails(&refs(&train_on(
        &model,
        &dir.join("run2"),
        &["--offload", "activations"],
    )));
    assert!(e.contains(OFFLOAD_ON_THE_CPU), "{e}");
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
    assert!(e.contains(OFFLOAD_ON_THE_CPU), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_with_offload_on_the_cpu_is_refused_by_name() {
    let e = fails(&[
        "bench",
        "--model",
        "tiny-llama3",
        "--batch",
        "2",
        "--seq",
        "16",
        "--lora-r",
        "4",
        "--steps",
        "1",
        "--offload",
        "activations",
    ]);
    assert!(e.contains(OFFLOAD_ON_THE_CPU), "{e}");
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
