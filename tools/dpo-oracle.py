#!/usr/bin/env python3
"""The oracle of `xtrain train --method dpo`: TRL's own DPOTrainer on the tiny random Llama
(tests/fixtures/tiny-llama3/model) with a byte-level tokenizer, three steps per case, recording
the loss, TRL's reward and log-prob metrics and every LoRA weight after each step.

Writes tests/fixtures/dpo/ (run once; the files are committed):
  tokenizer.json, tokenizer_config.json   a byte-level BPE (256 byte tokens; <|im_start|> 256,
                                          <|im_end|> 257 = EOS, <|endoftext|> 258 = pad) with a
                                          ChatML template, the same as tests/common's tiny text model
  pairs.jsonl                             4 plain-text pairs (one longer than --seq 48: truncated)
  chat_pairs.jsonl                        4 conversational pairs (messages through the template)
  init/                                   the starting adapter (PEFT, r=2, alpha=4, all seven
                                          projections; A and B random, so the base model and the
                                          starting adapter are different references)
  CASE.safetensors                        step{1,2,3}.<PEFT tensor name> after each step
  cases.json                              per case: the xtrain flags it stands for, TRL's settings
                                          and its logged metrics per step

TRL's settings, as xtrain's flags say them: AdamW 0.9/0.999/1e-8 (torch's), no weight decay,
max_grad_norm 1.0, constant learning rate 1e-3, dropout off, f32 on the CPU, max_length 48
(keep_start truncation). Every case trains on all 4 pairs each step (one batch of 4 pairs, or
2 x 2 with gradient accumulation), so the batches do not depend on either side's shuffle.

The base reference is TRL with `ref_model` = the model without the adapter; the start reference
is TRL's own copy of the adapter the model arrives with (a PeftModel and no ref_model). cDPO
(xtrain's --label-smoothing) is TRL's sigmoid and robust losses combined, whose weighted sum
2(1-e) * sigmoid - (1-2e) * robust is -(1-e) logsigmoid(b z) - e logsigmoid(-b z).

Run: /work/venv-oracle/bin/python tools/dpo-oracle.py  (torch, transformers, peft, trl).
"""

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers
import peft
import trl
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import AutoTokenizer, LlamaForCausalLM, TrainerCallback
from trl import DPOConfig, DPOTrainer

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests/fixtures/tiny-llama3/model"
OUT = ROOT / "tests/fixtures/dpo"
SEQ = 48
LR = 1e-3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def byte_chars():
    """GPT-2's reversible byte -> printable char map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    m = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in m:
            m[b] = chr(256 + n)
            n += 1
    return [m[b] for b in range(256)]


def write_tokenizer(d: Path):
    vocab = {c: i for i, c in enumerate(byte_chars())}
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    added = []
    for k, t in enumerate(specials):
        vocab[t] = 256 + k
        added.append({"id": 256 + k, "content": t, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }
    (d / "tokenizer.json").write_text(json.dumps(tok))
    cfg = {
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


PAIRS = [
    {"prompt": "Q: 2+2? A:", "chosen": " 4", "rejected": " 5"},
    {"prompt": "Capital of France?", "chosen": " Paris.", "rejected": " Rome, I think."},
    {"prompt": "Say hi.", "chosen": " hi", "rejected": " no"},
    # 40 + 20 characters: longer than --seq 48 with its EOS, truncated (keep_start).
    {"prompt": "Tell me a long story about a cat please", "chosen": " Once a cat sat on a mat", "rejected": " No."},
]

CHAT_PAIRS = [
    {"prompt": [{"role": "user", "content": "2+2?"}],
     "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "22"}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
     "chosen": [{"role": "assistant", "content": "Hello"}], "rejected": [{"role": "assistant", "content": "Go away"}]},
    {"prompt": [{"role": "user", "content": "Sky?"}],
     "chosen": [{"role": "assistant", "content": "Blue"}], "rejected": [{"role": "assistant", "content": "Green"}]},
    {"prompt": [{"role": "user", "content": "Cat or dog?"}],
     "chosen": [{"role": "assistant", "content": "Both"}], "rejected": [{"role": "assistant", "content": "?"}]},
]


def write_jsonl(path: Path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_init_adapter(model_dir: Path, out: Path):
    """A LoRA adapter whose A and B are both random (B scaled to 0.1 of nn.Linear's init)."""
    torch.manual_seed(1234)
    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=TARGETS,
                     init_lora_weights=False, task_type="CAUSAL_LM")
    m = get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.mul_(0.1)
    m.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)


class Record(TrainerCallback):
    """Each step's logged metrics and LoRA weights."""

    def __init__(self):
        self.logs, self.weights = [], []
        self.model = None

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.logs.append({"step": state.global_step, **logs})

    def on_step_end(self, args, state, control, model=None, **kw):
        sd = get_peft_model_state_dict(model)
        self.weights.append({k: v.detach().clone().float().contiguous() for k, v in sd.items()})


def run_case(name, model_dir, data, loss_types, loss_weights=None, label_smoothing=0.0,
             reference="base", grad_accum=1, flags=()):
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, OUT / "init", is_trainable=True)
    ref_model = None
    if reference == "base":
        ref_model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(
            output_dir=tmp, per_device_train_batch_size=4 // grad_accum,
            gradient_accumulation_steps=grad_accum, max_steps=3, learning_rate=LR,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
            adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, beta=0.1, loss_type=loss_types,
            loss_weights=loss_weights, label_smoothing=label_smoothing, max_length=SEQ,
            logging_steps=1, save_strategy="no", report_to=[], bf16=False, fp16=False,
            use_cpu=True, gradient_checkpointing=False, seed=0, disable_dropout=True,
            dataloader_drop_last=False,
        )
        rec = Record()
        trainer = DPOTrainer(model=model, ref_model=ref_model, args=args,
                             train_dataset=Dataset.from_list(data), processing_class=tok,
                             callbacks=[rec])
        if reference == "start":
            assert "ref" in model.peft_config, "TRL made no frozen copy of the starting adapter"
        else:
            assert "ref" not in model.peft_config
        tokenized = [{k: row[k] for k in ["prompt_ids", "chosen_ids", "rejected_ids"]}
                     for row in trainer.train_dataset]
        trainer.train()
    assert len(rec.weights) == 3 and len(rec.logs) == 3, (len(rec.weights), rec.logs)
    tensors = {}
    for s, w in enumerate(rec.weights, start=1):
        for k, v in w.items():
            tensors[f"step{s}.{k}"] = v
    save_file(tensors, OUT / f"{name}.safetensors")
    keep = ["loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins",
            "rewards/accuracies", "logps/chosen", "logps/rejected"]
    steps = [{k: l[k] for k in ["step"] + keep} for l in rec.logs]
    print(name, json.dumps(steps[0]), file=sys.stderr)
    return {"flags": list(flags), "loss_type": loss_types, "loss_weights": loss_weights,
            "label_smoothing": label_smoothing, "reference": reference,
            "gradient_accumulation_steps": grad_accum, "steps": steps, "tokenized": tokenized}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    write_tokenizer(OUT)
    write_jsonl(OUT / "pairs.jsonl", PAIRS)
    write_jsonl(OUT / "chat_pairs.jsonl", CHAT_PAIRS)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        for f in ["config.json", "model.safetensors"]:
            shutil.copy(MODEL / f, model_dir / f)
        for f in ["tokenizer.json", "tokenizer_config.json"]:
            shutil.copy(OUT / f, model_dir / f)
        if (OUT / "init").exists():
            shutil.rmtree(OUT / "init")
        make_init_adapter(model_dir, OUT / "init")
        eps = 0.1
        cases = {
            "sigmoid_base": run_case("sigmoid_base", model_dir, PAIRS, ["sigmoid"],
                                     flags=["--reference", "base"]),
            "ipo_base": run_case("ipo_base", model_dir, CHAT_PAIRS, ["ipo"],
                                 flags=["--reference", "base", "--dpo-loss", "ipo"]),
            "sigmoid_start": run_case("sigmoid_start", model_dir, PAIRS, ["sigmoid"],
                                      reference="start", flags=["--reference", "start"]),
            "sigmoid_base_accum2": run_case("sigmoid_base_accum2", model_dir, PAIRS, ["sigmoid"],
                                            grad_accum=2,
                                            flags=["--reference", "base", "--grad-accum", "2"]),
            "hinge_start": run_case("hinge_start", model_dir, CHAT_PAIRS, ["hinge"],
                                    reference="start", flags=["--dpo-loss", "hinge"]),
            "cdpo_base": run_case("cdpo_base", model_dir, PAIRS, ["sigmoid", "robust"],
                                  loss_weights=[2 * (1 - eps), -(1 - 2 * eps)], label_smoothing=eps,
                                  flags=["--reference", "base", "--label-smoothing", str(eps)]),
        }
    meta = {
        "made_by": "tools/dpo-oracle.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "trl": trl.__version__},
        "model": "tests/fixtures/tiny-llama3/model",
        "train_flags": ["--seq", str(SEQ), "--batch-size", "4", "--steps", "3", "--lr", str(LR),
                        "--max-grad-norm", "1", "--beta", "0.1", "--init-adapter", "init"],
        "cases": cases,
    }
    (OUT / "cases.json").write_text(json.dumps(meta, indent=1) + "\n")
    first = cases["sigmoid_start"]["steps"][0]["loss"]
    assert abs(first - math.log(2)) < 1e-6, f"start reference: first loss {first}, not ln 2"


if __name__ == "__main__":
    main()
