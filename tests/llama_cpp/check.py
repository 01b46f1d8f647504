"""The client side of tests/llama_cpp.rs: what llama.cpp (llama-cpp-python) and llama.cpp's own
GGUF reader (the `gguf` package) make of the GGUF files xtrain writes and reads. Each command
prints one JSON object on stdout; the Rust test asserts on it.

Run with the venv Python of tests/common's `llama_cpp_python()`.
"""

import json
import struct
import sys

import numpy as np


def read_safetensors(path):
    """A safetensors file as {name: float32 array} (F32, F16 and BF16 tensors), read directly."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = data[8 + n + start : 8 + n + end]
        dtype = info["dtype"]
        if dtype == "F32":
            a = np.frombuffer(raw, dtype="<f4")
        elif dtype == "F16":
            a = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        elif dtype == "BF16":
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype == "I64":
            a = np.frombuffer(raw, dtype="<i8")
        else:
            continue
        out[name] = a.reshape(info["shape"])
    return out


def to_llama_cpp_rows(w, heads):
    """llama.cpp's row order for q and k, written independently of xtrain's: per head, the
    Hugging Face rows [2 halves, head_dim/2] become [head_dim/2, 2 halves]."""
    rows = w.shape[0]
    return (
        w.reshape(heads, 2, rows // heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf):
    """llama.cpp's tensor name of a Hugging Face weight (the q/k/v biases of Qwen2 and the q/k
    norms of Qwen3 included)."""
    table = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in table:
        return table[hf]
    kinds = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    _, _, layer, rest = hf.split(".", 3)
    kind, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{kinds[kind]}.{suffix}"


def permuted(reader):
    """Whether the file's architecture keeps q and k rows in llama.cpp's interleaved order:
    `llama` does (its RoPE rotates adjacent pairs); `qwen2` and `qwen3` rotate halves, as
    Hugging Face does, and keep the rows as they are."""
    field = reader.fields["general.architecture"]
    return field.contents() == "llama"


def dequantized(path):
    """Every tensor of a GGUF file as float32, in Hugging Face's (row-major) shape, by name,
    dequantized by the `gguf` package."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    out = {}
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type)
        shape = [int(d) for d in reversed(list(t.shape))]
        out[t.name] = (np.asarray(values, dtype=np.float32).reshape(shape), t.tensor_type.name)
    return reader, out


def cmd_merged(gguf_path, model_dir, adapter_dir):
    """Each tensor of an exported file against W + (alpha/r) B A computed here in float64 from
    the model's and the adapter's safetensors, in units of the tolerance of the type it was
    written in (a ratio up to 1 passes):
      F32: 1e-6 * (1 + |expected|) (f32 rounding of the merge, whatever order it summed in);
      F16: half an f16 ulp of the expected value, 2^-11 |x| (normal range) or 2^-25 (subnormal),
           plus the f32 merge's rounding;
      BF16: 2^-8 |x| plus the same;
      Q8_0: half a quantization step of the value's block of 32 (absmax / 127 / 2) plus the
           f16 rounding of the step times 127 (2^-11 absmax), plus the same."""
    config = json.load(open(f"{model_dir}/config.json"))
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    weights = read_safetensors(f"{model_dir}/model.safetensors")
    lora = {}
    scale = None
    if adapter_dir:
        acfg = json.load(open(f"{adapter_dir}/adapter_config.json"))
        scale = acfg["lora_alpha"] / acfg["r"]
        lora = read_safetensors(f"{adapter_dir}/adapter_model.safetensors")
    reader, tensors = dequantized(gguf_path)
    reorder = permuted(reader)
    worst = {"ratio": 0.0}
    checked = 0
    adapted = 0
    for hf, w in weights.items():
        if hf == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        expected = w.astype(np.float64)
        module = hf[: -len(".weight")]
        a = lora.get(f"base_model.model.{module}.lora_A.weight")
        if a is not None:
            b = lora[f"base_model.model.{module}.lora_B.weight"]
            expected = expected + scale * (b.astype(np.float64) @ a.astype(np.float64))
            adapted += 1
        if reorder and hf.endswith("q_proj.weight"):
            expected = to_llama_cpp_rows(expected, heads)
        elif reorder and hf.endswith("k_proj.weight"):
            expected = to_llama_cpp_rows(expected, kv_heads)
        got, ty = tensors[gguf_name(hf)]
        got = got.astype(np.float64)
        assert got.shape == expected.shape, (hf, got.shape, expected.shape)
        merge = 1e-6 * (1 + np.abs(expected))
        if ty == "F32":
            tol = merge
        elif ty == "F16":
            tol = np.maximum(np.abs(expected) * 2.0**-11, 2.0**-25) + merge
        elif ty == "BF16":
            tol = np.abs(expected) * 2.0**-8 + 2.0**-133 + merge
        elif ty == "Q8_0":
            blocks = expected.reshape(-1, 32)
            amax = np.abs(blocks).max(axis=1, keepdims=True)
            step = amax / 127.0
            tol = (0.5 * step + amax * 2.0**-11 + 1e-30).repeat(32, axis=1).reshape(
                expected.shape
            ) + merge
        else:
            raise SystemExit(f"{hf}: unexpected type {ty}")
        ratio = float((np.abs(got - expected) / tol).max())
        if ratio > worst["ratio"]:
            worst = {"ratio": ratio, "tensor": hf, "type": ty}
        checked += 1
    print(json.dumps({"checked": checked, "adapted": adapted, "worst": worst}))


def cmd_metadata(gguf_path):
    """The file's scalar and string metadata (arrays by length), and its tensors' types."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        meta[key] = {"len": len(value)} if isinstance(value, list) else value
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    print(json.dumps({"meta": meta, "types": types}, default=str))


def Llama(**kwargs):
    """llama_cpp.Llama with llama.cpp's extra CPU buffer types off (`--no-extra-bufts`): on a
    CPU with AMX, llama.cpp repacks Q8_0/Q4_0 weights for its AMX kernels, whose matmul crashes
    (SIGSEGV) in llama-cpp-python 0.3.36 on this project's machines, for llama.cpp's own Q8_0
    files as for ours. The plain CPU kernels are what every other CPU runs."""
    import llama_cpp

    low = llama_cpp.llama_cpp
    if not getattr(low, "_xtrain_no_extra_bufts", False):
        default = low.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        low.llama_model_default_params = params
        low._xtrain_no_extra_bufts = True
    return llama_cpp.Llama(**kwargs)


def cmd_logits(gguf_path, lora_path, inputs_path, expected_path):
    """llama.cpp's logits for the fixture's first row of input ids against the oracle's."""
    ids = [int(i) for i in read_safetensors(inputs_path)["input_ids"][0]]
    expected = read_safetensors(expected_path)["logits"][0]
    llm = Llama(
        model_path=gguf_path,
        lora_path=lora_path or None,
        n_ctx=len(ids),
        n_batch=len(ids),
        logits_all=True,
        # An f32 KV cache: llama.cpp's default f16 one rounds keys and values.
        type_k=0,
        type_v=0,
        n_threads=2,
        verbose=False,
    )
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)], dtype=np.float64)
    diff = float(np.abs(got - expected).max())
    print(json.dumps({"max_abs_diff": diff, "max_abs": float(np.abs(expected).max())}))


def cmd_chat(gguf_path, lora_path, prompt, max_tokens):
    """llama.cpp's greedy answer to one user message, with the file's own chat template."""
    llm = Llama(
        model_path=gguf_path,
        lora_path=lora_path or None,
        n_ctx=256,
        n_threads=2,
        verbose=False,
    )
    out = llm.create_chat_completion(
        messages=[{"role": "user", "content": prompt}],
        max_tokens=int(max_tokens),
        temperature=0.0,
    )
    print(json.dumps({"text": out["choices"][0]["message"]["content"]}))


def cmd_tokens(gguf_path, text):
    """llama.cpp's token ids for `text`, as the file says to tokenize it (its split, its BOS
    where the file's add_bos_token says so)."""
    llm = Llama(model_path=gguf_path, n_ctx=64, n_threads=2, verbose=False)
    print(json.dumps({"tokens": llm.tokenize(text.encode(), add_bos=True)}))


def cmd_tokens_each(gguf_path, texts_json):
    """`tokens` for each text of a JSON list, the model loaded once: {"tokens": [ids, ...]}."""
    llm = Llama(model_path=gguf_path, n_ctx=64, n_threads=2, verbose=False)
    texts = json.loads(texts_json)
    print(json.dumps({"tokens": [llm.tokenize(t.encode(), add_bos=True) for t in texts]}))


def cmd_quantize(src, dst, ftype):
    """llama.cpp's own quantizer (llama_model_quantize) on an exported file."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    _, tensors = dequantized(dst)
    types = sorted({ty for _, ty in tensors.values()})
    print(json.dumps({"rc": rc, "types": types}))


def cmd_imported(gguf_path, model_dir):
    """A model directory xtrain imported from `gguf_path` against the `gguf` package's
    dequantization of the same file (q and k rows put back in Hugging Face's order): the
    largest absolute difference, which must be 0."""
    config = json.load(open(f"{model_dir}/config.json"))
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    weights = read_safetensors(f"{model_dir}/model.safetensors")
    reader, tensors = dequantized(gguf_path)
    reorder = permuted(reader)
    worst = {"diff": 0.0}
    checked = 0
    for hf, w in weights.items():
        got, ty = tensors[gguf_name(hf)]
        if reorder and (hf.endswith("q_proj.weight") or hf.endswith("k_proj.weight")):
            h = heads if "q_proj" in hf else kv_heads
            rows = got.shape[0]
            got = got.reshape(h, rows // h // 2, 2, -1).swapaxes(1, 2).reshape(got.shape)
        diff = float(np.abs(w.astype(np.float64) - got.astype(np.float64)).max())
        if diff >= worst["diff"]:
            worst = {"diff": diff, "tensor": hf, "type": ty}
        checked += 1
    print(json.dumps({"checked": checked, "worst": worst}))


def cmd_blocks(path, seed):
    """A GGUF file with one tensor of random blocks of each quantized type xtrain reads (their
    f16 scales set to finite values), each beside `<name>.expected`: the `gguf` package's
    dequantization of the same bytes, as F32."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    rng = np.random.default_rng(int(seed))
    # Where each type's f16 scales sit in its block.
    halves = {
        T.Q5_0: [0],
        T.Q5_1: [0, 2],
        T.Q2_K: [80, 82],
        T.Q3_K: [108],
        T.Q4_K: [0, 2],
        T.Q5_K: [0, 2],
        T.Q6_K: [208],
        T.Q4_0: [0],
        T.Q4_1: [0, 2],
        T.Q8_0: [0],
    }
    writer = GGUFWriter(path, "llama")
    for ty, offsets in halves.items():
        block, size = GGML_QUANT_SIZES[ty]
        rows, blocks_per_row = 4, max(1, 512 // block)
        raw = rng.integers(0, 256, size=(rows, blocks_per_row, size), dtype=np.uint8)
        for off in offsets:
            scales = rng.normal(0, 0.05, size=(rows, blocks_per_row)).astype(np.float16)
            raw[:, :, off : off + 2] = scales.view(np.uint8).reshape(rows, blocks_per_row, 2)
        raw = raw.reshape(rows, blocks_per_row * size)
        writer.add_tensor(ty.name.lower(), raw, raw_dtype=ty)
        writer.add_tensor(
            ty.name.lower() + ".expected", np.asarray(dequantize(raw, ty), dtype=np.float32)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(json.dumps({"types": [t.name for t in halves]}))


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    {
        "merged": cmd_merged,
        "metadata": cmd_metadata,
        "logits": cmd_logits,
        "chat": cmd_chat,
        "quantize": cmd_quantize,
        "imported": cmd_imported,
        "tokens": cmd_tokens,
        "tokens-each": cmd_tokens_each,
        "blocks": cmd_blocks,
    }[cmd](*args)
