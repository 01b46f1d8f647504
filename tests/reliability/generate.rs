//! `xtrain generate`: non-finite logits and the context limit.

use super::*;

#[test]
fn generate_refuses_non_finite_logits_instead_of_printing_nul_bytes() {
    let dir = tempdir("rel-generate-nan");
    let model = tiny_text_model(&dir);
    // Finite (a NaN adapter is refused when read) but past f32 once multiplied.
    let adapter = edited_adapter(
        &dir.join("nan-adapter"),
        "adapter_init",
        |_| {},
        |t| {
            for v in t.values_mut() {
                let n = v.to_f32().unwrap().len();
                *v = pjrt::HostTensor::from_f32(&vec![1e30; n], &v.dims);
            }
        },
    );
    let o = xtrain(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--prompt",
        "hello",
        "--raw",
        "--context",
        "16",
    ]);
    let err = stderr_of(&o);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.starts_with("error: ") && !err.contains("panicked"),
        "{err}"
    );
    assert!(
        err.contains("next-token logits after 5 tokens are not finite"),
        "{err}"
    );
    assert!(o.stdout.is_empty(), "nothing printed: {:?}", o.stdout);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn generate_says_when_it_stops_at_the_context_limit() {
    let dir = tempdir("rel-generate");
    let model = tiny_text_model(&dir);
    let o = xtrain(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hello",
        "--raw",
        "--context",
        "8",
        "--max-new-tokens",
        "100",
    ]);
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("stopped at the context limit"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn generate_with_a_context_longer_than_the_models_max_position_embeddings_is_refused() {
    let dir = tempdir("rel-max-positions-generate");
    let model = model_with_max_positions(&dir, 64);
    let e = fails(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hi",
        "--context",
        "128",
    ]);
    assert!(
        e.contains(
            "--context 128 is longer than the model's max_position_embeddings 64 (config.json)"
        ),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
