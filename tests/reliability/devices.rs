//! Plugins and devices: missing, old or wrong plugins, hardware that is not here, a step too big
//! for the machine.

use super::*;

#[test]
fn bad_plugins_and_output_dirs() {
    let dir = tempdir("rel-plugin");
    let out = dir.join("out");
    let model = fixtures().join("model");
    let e = fails(&refs(&train_on(
        &model,
        &out,
        &["--plugin", "/nonexistent/plugin.so"],
    )));
    assert!(
        e.contains("plugin file /nonexistent/plugin.so does not exist"),
        "{e}"
    );
    let not_plugin = dir.join("fake.so");
    std::fs::write(&not_plugin, b"not an ELF file").unwrap();
    let e = fails(&refs(&train_on(
        &model,
        &out,
        &["--plugin", not_plugin.to_str().unwrap()],
    )));
    assert!(e.contains("cannot load PJRT plugin"), "{e}");
    // A real shared object that is not a PJRT plugin: libc.
    let libc = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
    .expect("libc");
    let e = fails(&refs(&train_on(&model, &out, &["--plugin", libc])));
    assert!(
        e.contains("not a PJRT plugin: it does not export GetPjrtApi"),
        "{e}"
    );
    let e = fails(&refs(&train_on(&model, &out, &["--plugin", "cuda-typo"])));
    assert!(e.contains("unknown plugin 'cuda-typo'"), "{e}");
    // An output path that is a file: refused before any work.
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let e = fails(&refs(&train_on(&model, &file, &[])));
    assert!(e.contains("cannot create output dir"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
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

/// A GPU recipe run on a machine where the CUDA plugin sees no GPU (here with
/// CUDA_VISIBLE_DEVICES empty) gets the plugin's error with what to do instead (compile for the
/// GPU, or train on the CPU), and none of the plugin's absl log lines unless -v.
#[test]
fn a_gpu_recipe_without_a_gpu_says_to_compile_for_it_or_train_on_the_cpu() {
    let dir = tempdir("rel-no-gpu");
    let recipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes/llama-3.1-8b-h100.toml");
    let model = tiny_text_model(&dir);
    let data = dir.join("d.jsonl");
    std::fs::write(&data, "{\"text\": \"hello there\"}\n".repeat(60)).unwrap();
    let run = |verbose: bool| {
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
        String::from_utf8_lossy(&o.stderr).to_string()
    };
    let all = run(false);
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
    // -v shows them.
    let verbose = run(true);
    assert!(verbose.lines().count() > all.lines().count(), "{verbose}");
    assert!(!dir.join("run/adapter").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `xtrain targets tpu:v5e` (a TPU asked for as a GPU description) says that TPUs need none
/// and shows the form a TPU target takes; an unknown generation lists the known ones.
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
    let mut a = train_on(&model, &dir.join("run"), &["--steps", "1"]);
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
