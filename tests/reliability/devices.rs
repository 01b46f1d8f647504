//! Plugins and devices: missing, old or wrong plugins, hardware that is not here, a step too big
//! for the machine.

use super::*;

/// `train` of the fixture model with `--plugin PLUGIN`, expected to fail: its error.
fn train_with_plugin(name: &str, plugin: &str) -> String {
    let dir = tempdir(name);
    let e = fails(&refs(&train_on(
        &fixtures().join("model"),
        &dir.join("out"),
        &["--plugin", plugin],
    )));
    std::fs::remove_dir_all(&dir).unwrap();
    e
}

#[test]
fn a_plugin_path_that_does_not_exist_is_refused() {
    let e = train_with_plugin("rel-plugin-missing", "/nonexistent/plugin.so");
    assert!(
        e.contains("plugin file /nonexistent/plugin.so does not exist"),
        "{e}"
    );
}

#[test]
fn a_plugin_file_that_is_not_a_shared_object_is_refused() {
    let dir = tempdir("rel-plugin-not-elf");
    let not_plugin = dir.join("fake.so");
    std::fs::write(&not_plugin, b"not an ELF file").unwrap();
    let e = train_with_plugin("rel-plugin-not-elf-run", not_plugin.to_str().unwrap());
    assert!(e.contains("cannot load PJRT plugin"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A real shared object that is not a PJRT plugin: libc.
#[test]
fn a_shared_object_that_is_not_a_pjrt_plugin_is_refused() {
    let libc = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
    .expect("libc");
    let e = train_with_plugin("rel-plugin-libc", libc);
    assert!(
        e.contains("not a PJRT plugin: it does not export GetPjrtApi"),
        "{e}"
    );
}

#[test]
fn an_unknown_plugin_name_is_refused() {
    let e = train_with_plugin("rel-plugin-unknown", "cuda-typo");
    assert!(e.contains("unknown plugin 'cuda-typo'"), "{e}");
}

#[test]
fn a_plugin_with_an_old_pjrt_api_is_refused_naming_both_versions() {
    // A shared object whose GetPjrtApi reports API 0.20: built here with the system C compiler.
    let dir = tempdir("rel-oldapi");
    let c = dir.join("old.c");
    std::fs::write(
        &c,
        "#include <stddef.h>\n\
         struct V { size_t s; void* e; int major; int minor; };\n\
         struct Api { size_t struct_size; void* ext; struct V v; void* fns[8]; };\n\
         static struct Api api = { sizeof(struct Api), 0, { sizeof(struct V), 0, 0, 20 }, {0} };\n\
         const struct Api* GetPjrtApi(void) { return &api; }\n",
    )
    .unwrap();
    let so = dir.join("libold_pjrt.so");
    let ok = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&c)
        .status()
        .expect("a C compiler (cc)")
        .success();
    assert!(ok);
    let e = fails(&refs(&train_on(
        &fixtures().join("model"),
        &dir.join("out"),
        &["--plugin", so.to_str().unwrap()],
    )));
    assert!(
        e.contains("speaks PJRT C API 0.20, but xtrain needs 0.40 or newer"),
        "{e}"
    );
    assert!(e.contains("(xtrain was written against 0.81)"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `train --config recipes/llama-3.1-8b-h100.toml` of the tiny text model where the CUDA plugin
/// sees no GPU (CUDA_VISIBLE_DEVICES empty), with `-v` if `verbose`: its stderr, having failed
/// without writing an adapter.
fn gpu_recipe_without_a_gpu(name: &str, verbose: bool) -> String {
    let dir = tempdir(name);
    let recipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes/llama-3.1-8b-h100.toml");
    let model = tiny_text_model(&dir);
    let data = dir.join("d.jsonl");
    std::fs::write(&data, "{\"text\": \"hello there\"}\n".repeat(60)).unwrap();
    let mut c = xtrain_cmd();
    if verbose {
        c.arg("-v");
    }
    let o = c
        .arg("train")
        .arg("--config")
        .arg(&recipe)
        .arg("--model")
        .arg(&model)
        .arg("--data")
        .arg(&data)
        .args(["--no-pack", "--out"])
        .arg(dir.join("run"))
        .env("CUDA_VISIBLE_DEVICES", "")
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(!dir.join("run/adapter").exists());
    std::fs::remove_dir_all(&dir).unwrap();
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// A GPU recipe run on a machine where the CUDA plugin sees no GPU (here with
/// CUDA_VISIBLE_DEVICES empty) gets the plugin's error with what to do instead (compile for the
/// GPU, or train on the CPU), and none of the plugin's absl log lines.
#[test]
fn a_gpu_recipe_without_a_gpu_says_to_compile_for_it_or_train_on_the_cpu() {
    let all = gpu_recipe_without_a_gpu("rel-no-gpu", false);
    // Notes on the run's setup come first (the recipe keys the command line overrides, the
    // held-out examples), one `xtrain: ` line each; then the error, alone.
    let (notes, err) = all.rsplit_once("\n").map_or(("", all.as_str()), |(a, b)| {
        if b.is_empty() {
            a.rsplit_once('\n').unwrap_or(("", a))
        } else {
            (a, b)
        }
    });
    for line in notes.lines() {
        assert!(line.starts_with("xtrain: "), "{all}");
    }
    assert!(
        err.starts_with("error: cannot create a client for "),
        "{all}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains(
            "If this machine has no cuda GPU: compile for one with `xtrain compile --target \
             cuda:<name>:<count> --check`"
        ) && err.contains("or train here on the CPU with --plugin cpu"),
        "{err}"
    );
    assert!(
        !err.contains("InitializeLog") && !err.contains("cuda drivers"),
        "no absl lines: {err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

/// -v shows the plugin's log lines that the run without it leaves out.
#[test]
fn a_gpu_recipe_without_a_gpu_shows_the_plugins_log_lines_with_v() {
    let all = gpu_recipe_without_a_gpu("rel-no-gpu-quiet", false);
    let verbose = gpu_recipe_without_a_gpu("rel-no-gpu-verbose", true);
    assert!(verbose.lines().count() > all.lines().count(), "{verbose}");
}

/// `xtrain targets tpu:v5e` (a TPU asked for as a GPU description) says that TPUs need none
/// and shows the form a TPU target takes.
#[test]
fn targets_of_a_tpu_says_it_needs_no_description_and_shows_its_form() {
    let o = xtrain(&["targets", "tpu:v5e"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains("TPUs need no description")
            && out.contains("compile with --target tpu:v5e:<chips>")
            && !out.contains("not a built-in GPU"),
        "{out}"
    );
}

#[test]
fn targets_of_an_unknown_tpu_generation_lists_the_known_ones() {
    let e = fails(&["targets", "tpu:v9"]);
    assert!(
        e.contains("unknown TPU generation `v9`") && e.contains("tpu:v5e:<chips>"),
        "{e}"
    );
}

#[test]
fn a_step_too_big_for_the_cpu_gives_xlas_figure_and_only_cpu_advice() {
    let dir = tempdir("rel-cpu-oom");
    let model = fixtures().join("model");
    // 4 rows of 131072 tokens (the tiny model's max_position_embeddings): attention's scores
    // alone take terabytes.
    let (b, t) = (4i64, 131072i64);
    let ids: Vec<i64> = (0..b * t).map(|i| (i * 7) % 500).collect();
    let batch = dir.join("big.safetensors");
    let tensors: std::collections::BTreeMap<String, pjrt::HostTensor> = [
        ("input_ids", pjrt::HostTensor::from_i64(&ids, &[b, t])),
        ("labels", pjrt::HostTensor::from_i64(&ids, &[b, t])),
        (
            "attention_mask",
            pjrt::HostTensor::from_i64(&vec![1; (b * t) as usize], &[b, t]),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    xtrain::formats::safetensors::write(&batch, &tensors, &Default::default()).unwrap();
    // Attention over every key at once: over key/value blocks (the default at this length)
    // the scores would be linear in the sequence, and the step would fit and run for hours.
    let mut a = train_on(
        &model,
        &dir.join("run"),
        &["--steps", "1", "--key-block", "off"],
    );
    let d = a.iter().position(|s| s == "--data").unwrap();
    a[d + 1] = batch.to_str().unwrap().into();
    let e = fails(&refs(&a));
    let advice = e.split("(the plugin said").next().unwrap();
    assert!(
        advice.contains("the training step does not fit the device: it needs at least ")
            && advice.contains(" GiB per device (XLA could not allocate a buffer of that size)"),
        "{e}"
    );
    // XLA's figure, not the arguments' few MiB.
    let at = advice.find("at least ").unwrap() + "at least ".len();
    let gib: f64 = advice[at..].split(' ').next().unwrap().parse().unwrap();
    assert!(gib > 100.0, "{e}");
    assert!(
        !advice.contains("--offload") && !advice.contains("--mesh"),
        "the CPU plugin can neither offload nor add memory with more devices: {e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
