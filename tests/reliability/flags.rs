//! Flags and recipe keys: out of range, contradictory or doing nothing is refused (or warned about)
//! before any work.

use super::*;

/// `compile --model tiny-llama3 FLAGS --out DIR/prog` (`FLAGS` may name another model) is
/// refused saying `message`, and writes nothing, for each of `cases`.
fn compile_is_refused(name: &str, cases: &[(&[&str], &str)]) {
    let dir = tempdir(name);
    let out = dir.join("prog");
    for (flags, message) in cases {
        let mut args = vec!["compile"];
        if !flags.contains(&"--model") {
            args.extend(["--model", "tiny-llama3"]);
        }
        args.extend(*flags);
        args.extend(["--out", out.to_str().unwrap()]);
        let e = fails(&args);
        assert!(e.contains(message), "{flags:?}: {e}");
        assert!(
            !out.exists(),
            "{flags:?}: nothing is written for a refused step"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `train` of the tiny text model with `flags` is refused saying `message` before any work
/// (nothing written), for each of `cases`.
fn train_is_refused_before_any_work(name: &str, cases: &[(&[&str], &str)]) {
    let dir = tempdir(name);
    let model = tiny_text_model(&dir);
    let data = dir.join("d.jsonl");
    std::fs::write(&data, "{\"text\": \"hello\"}\n").unwrap();
    let out = dir.join("out");
    for (flags, message) in cases {
        let mut args: Vec<String> = ["train", "--model", model.to_str().unwrap()]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend(["--data".into(), data.to_str().unwrap().into()]);
        args.extend(["--out".into(), out.to_str().unwrap().into()]);
        args.extend(flags.iter().map(|s| s.to_string()));
        let e = fails(&refs(&args));
        assert!(e.contains(message), "{flags:?}: {e}");
        assert!(!out.exists(), "{flags:?}: nothing written");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_attention_block_or_grad_accum_that_does_not_divide_the_batch_is_refused() {
    compile_is_refused(
        "rel-step-divisors",
        &[
            (
                &["--seq", "48", "--attention-block", "32"],
                "--attention-block 32 must be a positive divisor of the sequence length 48",
            ),
            (
                &["--batch", "3", "--grad-accum", "2"],
                "--grad-accum 2 must divide the batch size 3",
            ),
        ],
    );
}

/// Long-context flags: a key block that is not a positive number of tokens, a context axis the
/// sequence cannot give two chunks per device, and the forms that a key block or a context
/// axis does not take.
#[test]
fn a_bad_key_block_or_context_split_is_refused() {
    let bad_value = "--key-block must be a positive number of tokens, off or auto";
    compile_is_refused(
        "rel-long-context",
        &[
            (&["--key-block", "0"], bad_value),
            (&["--key-block", "-4"], bad_value),
            (&["--key-block", "nan"], bad_value),
            (
                &["--seq", "20", "--mesh", "context=4"],
                "--seq 20 must be a multiple of 8",
            ),
            (
                &["--seq", "16", "--mesh", "context=2", "--key-block", "off"],
                "give --key-block N or auto, not off",
            ),
            (
                &[
                    "--seq",
                    "16",
                    "--mesh",
                    "context=2",
                    "--attention-block",
                    "8",
                ],
                "which a sequence split over the context axis does not use",
            ),
            (
                &["--seq", "16", "--key-block", "8", "--attention-block", "8"],
                "with key/value blocks of 8 (--key-block 8, or auto above 8192 tokens) the query \
                 blocks are the key blocks",
            ),
        ],
    );
}

#[test]
fn an_unknown_value_of_a_step_option_is_refused() {
    compile_is_refused(
        "rel-step-values",
        &[
            (
                &["--matmul-result", "bf32"],
                "invalid value 'bf32' for '--matmul-result <MATMUL_RESULT>'",
            ),
            (
                &["--attention-scores", "bf16"],
                "invalid value 'bf16' for '--attention-scores <ATTENTION_SCORES>'",
            ),
            (
                &["--keep-softmax-stats", "maybe"],
                "invalid value 'maybe' for '--keep-softmax-stats <BOOL>'",
            ),
            (
                &["--remat", "save_proj"],
                "--remat must be auto, none, layer or save-proj, got `save_proj`",
            ),
        ],
    );
}

#[test]
fn keep_softmax_stats_without_remat_layer_is_refused() {
    compile_is_refused(
        "rel-step-softmax-stats",
        &[(
            &["--remat", "none", "--keep-softmax-stats", "true"],
            "--keep-softmax-stats is for --remat layer",
        )],
    );
}

#[test]
fn pin_mlp_activations_on_one_device_is_refused() {
    compile_is_refused(
        "rel-step-pin-mlp",
        &[(
            &["--pin-mlp-activations", "true"],
            "--pin-mlp-activations places activations on a device mesh, but this step runs on one device",
        )],
    );
}

#[test]
fn a_train_flag_out_of_range_is_refused_before_any_work() {
    train_is_refused_before_any_work(
        "rel-ranges-train",
        &[
            (&["--lr", "nan"], "--lr must be a number >= 0, got NaN"),
            (&["--lr=-1"], "--lr must be a number >= 0"),
            (
                &["--eval-fraction", "1.5"],
                "--eval-fraction must be in [0, 1), got 1.5",
            ),
            (
                &["--lora-alpha", "0"],
                "--lora-alpha must be a positive number, got 0",
            ),
            (
                &["--loss-chunk", "0"],
                "--loss-chunk 0 must be a positive divisor",
            ),
            (
                &["--batch-size", "0"],
                "--batch-size must be at least 1, got 0",
            ),
            (&["--seq=-1"], "--seq must be at least 2"),
            // A negative value without `=` is a value, not an unknown argument `-1`.
            (
                &["--attention-block", "-1"],
                "--attention-block must be a positive number of query rows, auto or off, got `-1`",
            ),
            (&["--lr", "-1"], "--lr must be a number >= 0, got -1"),
            (
                &["--lora-dropout", "-0.1"],
                "--lora-dropout must be in [0, 1), got -0.1",
            ),
            (&["--epochs", "0"], "--epochs must be at least 1"),
            (&["--eps", "0"], "--eps must be a positive number"),
            (&["--min-lr-ratio", "2"], "--min-lr-ratio must be in [0, 1]"),
            (&["--stop-after", "0"], "--stop-after must be at least 1"),
            (
                &["--schedule", "cosin"],
                "--schedule must be constant, linear or cosine",
            ),
        ],
    );
}

#[test]
fn an_unknown_mesh_axis_is_refused_before_any_work() {
    train_is_refused_before_any_work(
        "rel-ranges-mesh-axis",
        &[
            (
                &["--mesh", "fdsp=8"],
                "unknown axis `fdsp` (did you mean `fsdp`?)",
            ),
            (&["--mesh", "dp=2"], "unknown axis `dp`"),
            (&["--mesh", "fsdp=8,model=8"], "unknown axis `model`"),
        ],
    );
}

#[test]
fn eval_fraction_and_eval_data_together_are_refused_before_any_work() {
    train_is_refused_before_any_work(
        "rel-ranges-eval-both",
        &[(
            &["--eval-fraction", "0.1", "--eval-data", "x.jsonl"],
            "--eval-fraction and --eval-data were both given",
        )],
    );
}

#[test]
fn sharding_rules_without_a_mesh_are_refused_before_any_work() {
    train_is_refused_before_any_work(
        "rel-ranges-rules-no-mesh",
        &[(
            &["--sharding-rules", "rules.txt"],
            "places tensors on a mesh: give --mesh too",
        )],
    );
}

#[test]
fn a_generate_flag_out_of_range_is_refused() {
    let dir = tempdir("rel-ranges-generate");
    let model = tiny_text_model(&dir);
    for (flags, message) in [
        (
            &["--temperature", "nan"][..],
            "--temperature must be a number >= 0",
        ),
        (
            &["--temperature=-1"][..],
            "--temperature must be a number >= 0",
        ),
        (&["--context", "0"][..], "--context must be at least 2"),
        (&["--context=-4"][..], "got -4"),
    ] {
        let mut args = vec!["generate", "--model", model.to_str().unwrap()];
        args.extend(["--prompt", "hi"]);
        args.extend(flags);
        let e = fails(&args);
        assert!(e.contains(message), "{flags:?}: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A preset typed as its model card writes it (`Llama-3.2-1B`) is pointed to the preset's
/// lower-case name.
#[test]
fn a_preset_in_capitals_is_pointed_to_its_name() {
    compile_is_refused(
        "rel-preset-capitals",
        &[(
            &["--model", "Llama-3.2-1B"],
            "did you mean --model llama-3.2-1b? (preset names are lower case)",
        )],
    );
}

#[test]
fn compile_batch_0_is_refused() {
    compile_is_refused(
        "rel-ranges-compile-batch",
        &[(&["--batch", "0"], "--batch-size must be at least 1, got 0")],
    );
}

#[test]
fn a_mesh_axis_that_splits_nothing_is_refused() {
    compile_is_refused(
        "rel-ranges-mesh-splits-nothing",
        &[(
            &["--batch", "4", "--mesh", "data=3"],
            "--mesh data=3 splits nothing",
        )],
    );
}

#[test]
fn an_unknown_logical_axis_in_the_sharding_rules_is_refused_naming_the_nearest() {
    let dir = tempdir("rel-ranges-rules");
    let rules = dir.join("rules.txt");
    std::fs::write(&rules, "batchh = data\n").unwrap();
    compile_is_refused(
        "rel-ranges-rules-compile",
        &[(
            &[
                "--mesh",
                "data=2",
                "--sharding-rules",
                rules.to_str().unwrap(),
            ],
            "unknown logical axis `batchh` (did you mean `batch`?)",
        )],
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// NF4 on a model whose projections are not whole blocks of 64.
#[test]
fn nf4_on_projections_that_are_not_whole_blocks_of_64_is_refused() {
    let dir = tempdir("rel-ranges-nf4");
    let odd = dir.join("odd");
    std::fs::create_dir_all(&odd).unwrap();
    let mut c: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("model/config.json")).unwrap(),
    )
    .unwrap();
    c["hidden_size"] = 36.into();
    c["intermediate_size"] = 36.into();
    c["num_attention_heads"] = 4.into();
    c["num_key_value_heads"] = 4.into();
    c["head_dim"] = 10.into();
    std::fs::write(odd.join("config.json"), c.to_string()).unwrap();
    compile_is_refused(
        "rel-ranges-nf4-compile",
        &[(
            &["--model", odd.to_str().unwrap(), "--quant", "nf4"],
            "--quant nf4 quantizes in blocks of 64 values",
        )],
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `compile --check` with `--remat auto` and `--offload auto` (the defaults) says what auto
/// chose and why (it said nothing; with a `--target` it says which target's memory chose).
#[test]
fn compile_check_says_what_auto_chose() {
    let dir = tempdir("rel-auto-chose");
    let out = dir.join("prog");
    let o = xtrain(&[
        "compile",
        "--model",
        "tiny-llama3",
        "--batch",
        "2",
        "--seq",
        "16",
        "--check",
        "--out",
        out.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}");
    assert!(
        stdout.contains(
            "auto chose --remat layer --offload none for this machine's plugin: without --target"
        ),
        "{stdout}"
    );
    // A policy given is not auto's: only the offload is said.
    let o = xtrain(&[
        "compile",
        "--model",
        "tiny-llama3",
        "--batch",
        "2",
        "--seq",
        "16",
        "--remat",
        "save-proj",
        "--check",
        "--overwrite",
        "--out",
        out.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}");
    assert!(stdout.contains("auto chose --offload none for"), "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Flags of `compile` that only mean something when it compiles (`--check`) are refused without
/// it, instead of being silently ignored.
#[test]
fn compile_flags_that_need_check_are_refused() {
    let dir = tempdir("rel-compile-check-flags");
    let out = dir.join("p");
    for (flags, message) in [
        (
            &["--xla-dump", "dump"][..],
            "--xla-dump dump writes what XLA's compiler made of the program, which runs only with --check",
        ),
        (
            &["--no-estimate"][..],
            "--no-estimate skips the TPU estimate of --check; without --check there is none",
        ),
        (
            &["--no-estimate", "--check", "--target", "cuda:h100:1"][..],
            "--no-estimate is for --check with a TPU --target",
        ),
        (
            &["--plugin", "cuda", "--target", "cuda:h100:1"][..],
            "--plugin names the plugin that compiles the program with --check",
        ),
        (
            &["--plugin", "bogus"][..],
            "--plugin names the plugin that compiles the program with --check",
        ),
    ] {
        let mut args = vec!["compile", "--model", "tiny-llama3", "--out", out.to_str().unwrap()];
        args.extend(flags);
        let e = fails(&args);
        assert!(e.contains(message), "{flags:?}: {e}");
        assert!(!out.exists(), "{flags:?}: nothing is written");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_target_given_twice_is_refused() {
    compile_is_refused(
        "rel-target-twice",
        &[(
            &["--target", "cuda:h100:1", "--target", "cuda:h100:1"],
            "--target cuda:h100:1 is given twice",
        )],
    );
}

/// A TPU layout that is not whole 2x2-chip hosts is refused without --check (libtpu refused it
/// only with --check), and `--target cpu` says that the CPU is what no --target gives.
#[test]
fn a_tpu_layout_libtpu_has_no_slice_of_and_the_cpu_as_a_target_are_refused_when_parsing() {
    compile_is_refused(
        "rel-target-layout",
        &[
            (
                &["--target", "tpu:v5e:2x1"],
                "the chip layout `2x1` is not a v5e slice",
            ),
            (
                &["--target", "cpu"],
                "the CPU is not a --target; it is what `xtrain compile` writes for without one",
            ),
        ],
    );
}

#[test]
fn targets_with_different_device_counts_are_refused_naming_both() {
    compile_is_refused(
        "rel-target-counts",
        &[(
            &["--target", "cuda:h100:1", "--target", "tpu:v5p:2x2x1"],
            "--target cuda:h100:1 has 1 device but --target tpu:v5p:2x2x1 has 4",
        )],
    );
}

/// `--grad-accum 0` is out of range, said as the other ranges are (it was "must divide the
/// batch size"), by train and compile alike.
#[test]
fn grad_accum_zero_is_out_of_range() {
    let dir = tempdir("rel-grad-accum-0");
    let model = fixtures().join("model");
    let e = fails(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--grad-accum", "0"],
    )));
    assert!(e.contains("--grad-accum must be at least 1, got 0"), "{e}");
    assert!(!dir.join("run").exists());
    let e = fails(&[
        "compile",
        "--model",
        model.to_str().unwrap(),
        "--grad-accum",
        "0",
        "--out",
        dir.join("prog").to_str().unwrap(),
    ]);
    assert!(e.contains("--grad-accum must be at least 1, got 0"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- flags and recipe keys

#[test]
fn a_flag_typed_twice_is_refused_naming_it_and_both_values() {
    let dir = tempdir("rel-twice");
    let model = fixtures().join("model");
    let (a, b) = (dir.join("a"), dir.join("b"));
    let mut args = train_on(&model, &a, &[]);
    args.extend(["--out".to_string(), b.to_str().unwrap().to_string()]);
    let e = fails(&refs(&args));
    assert!(
        e.contains(&format!(
            "--out is given twice on the command line ({}, then {}); give it once",
            a.display(),
            b.display()
        )),
        "{e}"
    );
    assert!(!a.exists() && !b.exists(), "nothing trained");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_switch_typed_twice_is_refused_naming_it() {
    let dir = tempdir("rel-twice-switch");
    let e = fails(&refs(&train_on(
        &fixtures().join("model"),
        &dir.join("a"),
        &["--no-plot"],
    )));
    assert!(
        e.contains("--no-plot is given twice on the command line"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_recipe_key_the_command_line_overrides_is_said_and_not_a_duplicate() {
    let dir = tempdir("rel-recipe-override");
    let model = fixtures().join("model");
    let recipe = dir.join("r.toml");
    std::fs::write(&recipe, "lora_r = 8\nsteps = 1\n").unwrap();
    let mut args = train_on(&model, &dir.join("run"), &[]);
    args.extend(["--config".to_string(), recipe.to_str().unwrap().to_string()]);
    let o = xtrain(&refs(&args));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "--lora-r 4 on the command line overrides the recipe {}'s --lora-r 8",
            recipe.display()
        )),
        "{err}"
    );
    assert_eq!(adapter_rank(&dir.join("run/adapter")), 4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_recipe_table_with_lora_r_and_lora_dash_r_is_refused_naming_both_keys() {
    let dir = tempdir("rel-recipe-same-flag");
    let recipe = dir.join("r.toml");
    std::fs::write(&recipe, "lora_r = 8\nlora-r = 16\n").unwrap();
    let e = fails(&[
        "compile",
        "--config",
        recipe.to_str().unwrap(),
        "--model",
        "tiny-llama3",
        "--out",
        dir.join("p").to_str().unwrap(),
    ]);
    assert!(
        e.contains("keys `lora-r` and `lora_r` in the top level both set --lora-r; keep one")
            || e.contains(
                "keys `lora_r` and `lora-r` in the top level both set --lora-r; keep one"
            ),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_recipe_section_with_lora_alpha_and_lora_dash_alpha_is_refused_naming_the_section() {
    let dir = tempdir("rel-recipe-same-flag-section");
    let recipe = dir.join("r.toml");
    std::fs::write(&recipe, "[train]\nlora_alpha = 8\nlora-alpha = 16\n").unwrap();
    let e = fails(&[
        "compile",
        "--config",
        recipe.to_str().unwrap(),
        "--model",
        "tiny-llama3",
        "--out",
        dir.join("p").to_str().unwrap(),
    ]);
    assert!(e.contains("in [train] both set --lora-alpha"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eval_every_without_eval_data_is_refused() {
    let dir = tempdir("rel-eval-every");
    let model = fixtures().join("model");
    let e = fails(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--eval-every", "20"],
    )));
    assert!(
        e.contains("--eval-every 20 (the command line) evaluates on held-out examples, but there are none: give --eval-data FILE or --eval-fraction F"),
        "{e}"
    );
    assert!(!dir.join("run").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn steps_and_epochs_both_typed_are_refused() {
    let dir = tempdir("rel-steps-epochs");
    let model = fixtures().join("model");
    let e = fails(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--steps", "3", "--epochs", "2"],
    )));
    assert!(
        e.contains("--steps 3 and --epochs 2 were both given (the command line): --steps sets the run's length, so --epochs would do nothing; give one of them"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn epochs_typed_over_a_recipes_steps_sets_the_length_and_says_so() {
    let dir = tempdir("rel-epochs-over-recipe");
    let model = tiny_text_model(&dir);
    let data = dir.join("d.jsonl");
    let lines: String = (0..6)
        .map(|i| format!("{{\"instruction\": \"Say {i}\", \"output\": \"{i}!\"}}\n"))
        .collect();
    std::fs::write(&data, lines).unwrap();
    let recipe = dir.join("r.toml");
    std::fs::write(&recipe, "steps = 50\n").unwrap();
    let out = dir.join("run");
    let o = train_cmd(&model, &data, &out)
        .args(["--config", recipe.to_str().unwrap(), "--epochs", "2"])
        .args([
            "--batch-size",
            "2",
            "--seq",
            "32",
            "--lora-r",
            "4",
            "--log-every",
            "0",
        ])
        .output()
        .unwrap();
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "--epochs 2 (the command line) sets the run's length instead of --steps 50 (the recipe {})",
            recipe.display()
        )),
        "{err}"
    );
    let m = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let steps = m.lines().filter(|l| l.contains("\"loss\"")).count();
    assert!(steps < 50, "two epochs, not the recipe's 50 steps: {steps}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn min_lr_ratio_with_a_constant_schedule_is_refused() {
    let dir = tempdir("rel-min-lr");
    let model = fixtures().join("model");
    let e = fails(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--min-lr-ratio", "0.1"],
    )));
    assert!(
        e.contains("--min-lr-ratio 0.1 (the command line) sets where a linear or cosine schedule ends, but --schedule is constant (the default)"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_warmup_longer_than_the_run_is_warned_about() {
    let dir = tempdir("rel-warmup");
    let model = fixtures().join("model");
    let o = xtrain(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--warmup", "100", "--lr", "1e-3"],
    )));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("warning: --warmup 100 is longer than the run (2 steps): the learning rate rises to 2e-5 at the last step and never reaches --lr 1e-3"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_empty_mesh_is_refused() {
    let dir = tempdir("rel-empty-mesh");
    let model = fixtures().join("model");
    let e = fails(&refs(&train_on(&model, &dir.join("run"), &["--mesh", ""])));
    assert!(
        e.contains("--mesh is empty: give its axes, such as --mesh fsdp=8, or leave it out"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn log_every_0_prints_no_progress() {
    let dir = tempdir("rel-log-every-0");
    let model = fixtures().join("model");
    let o = xtrain(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--steps", "3"],
    )));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        !err.contains("step 1/") && !err.contains("loaded") && !err.contains("peak host memory"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_help_of_log_every_says_what_0_still_prints() {
    let help = String::from_utf8_lossy(&xtrain(&["train", "--help"]).stdout).to_string();
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        help.contains("0: no progress (no bars, step lines or loading lines); evaluation results, notes on what the run sets up"),
        "{help}"
    );
}

/// A `--target` typed over a recipe's replaces it (said as an override) rather than joining it:
/// `--target` may be repeated, so keeping both would compile for the recipe's hardware too.
/// A recipe's `--attention-block` on a context axis: the refusal names the recipe (it said
/// "leave it out", of a flag the user never typed), and `--attention-block auto` (or `off`),
/// which the parser refused, unsets it; a negative value is refused by xtrain, not clap.
#[test]
fn a_recipes_attention_block_is_named_and_unset_by_auto() {
    let dir = tempdir("rel-recipe-attention-block");
    let recipe = dir.join("r.toml");
    std::fs::write(
        &recipe,
        "model = \"tiny-llama3\"\nbatch_size = 2\nseq = 16\nattention_block = 8\n",
    )
    .unwrap();
    let out = dir.join("p");
    let args = |extra: &[&'static str]| {
        let mut a = vec![
            "compile".to_string(),
            "--config".into(),
            recipe.to_str().unwrap().into(),
            "--mesh".into(),
            "context=2".into(),
            "--overwrite".into(),
            "--out".into(),
            out.to_str().unwrap().into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let e = fails_after_notes(&refs(&args(&[])));
    assert!(
        e.contains(&format!(
            "the recipe {} gives --attention-block 8, which sets the query blocks",
            recipe.display()
        )) && e.contains("give --attention-block auto"),
        "{e}"
    );
    for unset in ["auto", "off"] {
        let o = xtrain(&refs(&args(&["--attention-block", unset])));
        assert!(
            o.status.success(),
            "{unset}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let e = fails_after_notes(&refs(&args(&["--attention-block", "-1"])));
    assert!(
        e.contains(
            "--attention-block must be a positive number of query rows, auto or off, got `-1`"
        ),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_target_typed_over_a_recipes_replaces_it() {
    let dir = tempdir("rel-recipe-target");
    let recipe = dir.join("r.toml");
    std::fs::write(
        &recipe,
        "model = \"tiny-llama3\"\nbatch_size = 4\nseq = 64\n[compile]\ntarget = \"tpu:v5p:2x2x1\"\n",
    )
    .unwrap();
    let out = dir.join("p");
    let o = xtrain(&[
        "compile",
        "--config",
        recipe.to_str().unwrap(),
        "--target",
        "cuda:h100:4",
        "--out",
        out.to_str().unwrap(),
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains("--target cuda:h100:4 on the command line overrides the recipe"),
        "{stderr}"
    );
    assert!(stdout.contains("target cuda:h100:4: 4 devices"), "{stdout}");
    assert!(!stdout.contains("tpu:v5p"), "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Flags that shape JSONL or Parquet examples into rows do nothing to a pre-tokenized batch:
/// refused, rather than silently ignored (`--eval-fraction` and a contradicting `--batch-size`
/// already were). With `--eval-data`, whose examples they shape, only `--no-pack` is refused.
#[test]
fn text_data_flags_with_a_pre_tokenized_batch_are_refused() {
    let dir = tempdir("rel-text-flags-batch");
    let model = fixtures().join("model");
    for flags in [
        &["--no-pack"][..],
        &["--train-on-prompt"],
        &["--strict-length"],
        &["--skip-bad-lines"],
        &["--text-column", "body"],
    ] {
        let e = fails(&refs(&train_on(&model, &dir.join("out"), flags)));
        assert!(
            e.contains(&format!(
                "{} (the command line) shapes JSONL or Parquet examples into rows, but --data",
                flags[0]
            )) && e.contains("is one pre-tokenized batch"),
            "{flags:?}: {e}"
        );
        assert!(!dir.join("out").exists(), "{flags:?}: nothing is written");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--matmul-result` and `--attention-scores` other than the defaults change nothing with f32
/// compute (the program is the same): said, not silently taken.
#[test]
fn result_types_with_f32_compute_are_said_to_change_nothing() {
    let dir = tempdir("rel-idle-result-types");
    let compile = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let mut args = vec![
            "compile",
            "--model",
            "tiny-llama3",
            "--batch",
            "2",
            "--seq",
            "16",
            "--lora-r",
            "4",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend(extra);
        let o = xtrain(&args);
        assert!(o.status.success(), "{}", stderr_of(&o));
        (
            stderr_of(&o),
            std::fs::read(out.join("train_step.mlir")).unwrap(),
        )
    };
    let (_, plain) = compile("plain", &[]);
    let (e, idle) = compile(
        "idle",
        &["--matmul-result", "compute", "--attention-scores", "f32"],
    );
    assert_eq!(plain, idle, "the same program");
    for flag in ["--matmul-result compute", "--attention-scores f32"] {
        assert!(
            e.contains(&format!("{flag} changes nothing with --dtype f32")),
            "{flag}: {e}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_save_every_longer_than_the_run_is_warned_about() {
    let dir = tempdir("rel-save-every-long");
    let out = dir.join("out");
    let o = xtrain(&refs(&train_on(
        &fixtures().join("model"),
        &out,
        &["--steps", "2", "--save-every", "100"],
    )));
    let e = stderr_of(&o);
    assert!(o.status.success(), "{e}");
    assert!(
        e.contains("--save-every 100 is longer than the run (2 steps): no checkpoint is written"),
        "{e}"
    );
    assert!(out.join("adapter").is_dir());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `generate --max-new-tokens 0` would generate nothing (it printed an empty line and exited 0).
#[test]
fn generate_max_new_tokens_0_is_refused() {
    let dir = tempdir("rel-generate-max-new-0");
    let model = tiny_text_model(&dir);
    let e = fails(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hi",
        "--max-new-tokens",
        "0",
    ]);
    assert!(e.contains("--max-new-tokens must be at least 1"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--eval-data` and `--skip-bad-lines` apply to Parquet files too, and `train --help` says so
/// (it said "JSONL file" and "JSONL lines").
#[test]
fn the_help_of_eval_data_and_skip_bad_lines_names_parquet_too() {
    let help = String::from_utf8_lossy(&xtrain(&["train", "--help"]).stdout).to_string();
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        help.contains(
            "--skip-bad-lines Skip JSONL lines or Parquet rows that are not valid examples"
        ),
        "{help}"
    );
    assert!(
        help.contains("--eval-data <EVAL_DATA> A separate JSONL or Parquet file to evaluate on"),
        "{help}"
    );
}

/// Every flag of every command has a line of help (`bench --batch`, `--seq`, `--warmup`,
/// `--plugin` and `merge --adapter` had none).
#[test]
fn every_flag_in_the_help_has_a_description() {
    for cmd in [
        "train",
        "compile",
        "generate",
        "bench",
        "merge",
        "import-gguf",
        "targets",
        "plugins",
    ] {
        let help = String::from_utf8_lossy(&xtrain(&[cmd, "--help"]).stdout).to_string();
        let lines: Vec<&str> = help.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let text = line.trim_start();
            let indent = line.len() - text.len();
            // A flag's line (not a description's continuation that starts with a flag).
            if !text.starts_with('-') || indent > 6 {
                continue;
            }
            // Its description: on its line after two spaces, or on the next, indented further.
            let same_line = text
                .split_once("  ")
                .is_some_and(|(_, d)| !d.trim().is_empty());
            let next_line = lines.get(i + 1).is_some_and(|n| {
                let t = n.trim_start();
                !t.is_empty() && !t.starts_with('-') && n.len() - t.len() > indent
            });
            assert!(
                same_line || next_line,
                "`xtrain {cmd} --help`: {line:?} has no description\n{help}"
            );
        }
    }
}

/// A flag of `train` put under `[compile]` (or of `compile` under `[train]`) is said to be the
/// other command's key, not a misspelt flag (it said "the nearest flag is --seq").
#[test]
fn a_train_key_under_compile_in_a_recipe_is_said_to_belong_under_train() {
    let dir = tempdir("rel-recipe-wrong-table");
    let recipe = dir.join("r.toml");
    std::fs::write(&recipe, "model = \"tiny-llama3\"\n[compile]\nlr = 1e-4\n").unwrap();
    let e = fails(&[
        "compile",
        "--config",
        recipe.to_str().unwrap(),
        "--out",
        dir.join("p").to_str().unwrap(),
    ]);
    assert!(
        e.contains(&format!(
            "{}: key `lr` in [compile] is a `train` key (a flag of `xtrain train`, not of \
             `xtrain compile`): put it under [train]",
            recipe.display()
        )),
        "{e}"
    );
    assert!(!e.contains("nearest"), "{e}");
    assert!(!dir.join("p").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A recipe value the flag cannot take (`lr = "fast"`) is refused naming the recipe and the
/// key, not as if typed on the command line (clap's "invalid value 'fast' for '--lr <LR>'").
#[test]
fn a_recipe_value_of_the_wrong_type_is_refused_naming_the_recipe_and_the_key() {
    let dir = tempdir("rel-recipe-bad-value");
    let recipe = dir.join("r.toml");
    for (text, want) in [
        (
            "lr = \"fast\"\n",
            "key `lr`: invalid value 'fast' for '--lr <LR>': invalid float literal",
        ),
        (
            "[train]\nmatmul_result = \"bf32\"\n",
            "key `matmul_result` in [train]: invalid value 'bf32' for '--matmul-result",
        ),
    ] {
        std::fs::write(&recipe, text).unwrap();
        let e = fails(&[
            "train",
            "--config",
            recipe.to_str().unwrap(),
            "--model",
            "m",
            "--data",
            "d.jsonl",
            "--out",
            dir.join("run").to_str().unwrap(),
        ]);
        assert!(
            e.starts_with(&format!("error: {}: {want}", recipe.display())),
            "{text:?}: {e}"
        );
        assert!(!dir.join("run").exists());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The mesh `compile` takes from `--target cuda:h100:3` (fsdp=3, no --mesh given) that splits
/// nothing is said to be the target's, with what would split something (it said "--mesh fsdp=3
/// splits nothing" to a user who gave no --mesh).
#[test]
fn a_mesh_taken_from_the_target_that_splits_nothing_is_said_to_come_from_the_target() {
    compile_is_refused(
        "rel-target-mesh-splits-nothing",
        &[(
            &["--target", "cuda:h100:3"],
            "the mesh taken from --target cuda:h100:3, fsdp=3, splits nothing: no dimension it \
             applies to is divisible by 3 (vocab 512, embed 64, q_heads 64, kv_heads 32, mlp \
             128, batch 1), so every tensor would be replicated over it; no mesh axis of 3 \
             devices divides them, so give a --batch-size divisible by 3 (e.g. --batch-size 3, \
             which fsdp=3 splits), or a --target with a number of devices that divides them (e.g. \
             --target cuda:h100:2)",
        )],
    );
}

/// The context axis keeps the key block asked for whatever the chunk's length: each chunk is
/// padded to whole blocks inside the step, where the block used to shrink to the largest size
/// dividing the chunk (2 tokens for 8,200 tokens over context=2, whose compile then ran for
/// more than 10 minutes). `compile` says the block, the chunk and its padding; a typed block
/// below 64 tokens is kept, since it was asked for.
#[test]
fn the_context_axis_keeps_the_key_block_asked_for() {
    let dir = tempdir("rel-context-blocks");
    for (seq, mesh, block, said) in [
        (
            "8200",
            "context=2",
            "auto",
            "--key-block 512 (blocks of 512 tokens; the sequence is split into chunks of 2050, \
             each padded to 2560)",
        ),
        (
            "100000",
            "context=8",
            "auto",
            "(blocks of 512 tokens; the sequence is split into chunks of 6250, each padded to 6656)",
        ),
        (
            "32000",
            "context=8",
            "auto",
            "(blocks of 512 tokens; the sequence is split into chunks of 2000, each padded to 2048)",
        ),
        (
            "8200",
            "context=2",
            "1",
            "(blocks of 1 token; the sequence is split into chunks of 2050)",
        ),
        (
            "8200",
            "context=2",
            "3",
            "(blocks of 3 tokens; the sequence is split into chunks of 2050, each padded to 2052)",
        ),
    ] {
        let out = dir.join(format!("{seq}-{block}"));
        let o = xtrain(&[
            "compile", "--model", "llama-3.1-8b", "--dtype", "bf16", "--batch", "1", "--seq", seq,
            "--mesh", mesh, "--key-block", block, "--out", out.to_str().unwrap(),
        ]);
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert!(text.contains(said), "{seq} {mesh} {block}: {text}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
