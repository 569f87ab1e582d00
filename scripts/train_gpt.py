"""Train the book's tiny GPT on the text shipped in attnbook/data and save its
weights there.

    python scripts/train_gpt.py  # writes the shipped weights
    python scripts/train_gpt.py --steps 50 --out /tmp/quick.pt  # a smoke run

The defaults took 17 minutes on a 2-core machine shared with other jobs (0.4 s
per step); on two idle cores a step takes about 0.2 s, some 8 minutes in all.

Reproducible: every random choice (initial weights, the order of training
windows) comes from --seed, and torch runs with deterministic algorithms on
--threads threads. The result is bit-for-bit repeatable with the same torch
version, CPU and thread count.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import torch

from attnbook.gpt import (
    CharTokenizer,
    GPTConfig,
    TinyGPT,
    load_training_text,
    save_checkpoint,
    train_val_split,
    training_step,
    window_loss,
)

DEFAULT_OUT = (
    Path(__file__).resolve().parents[1]
    / "code"
    / "attnbook"
    / "data"
    / "tiny_gpt.pt"
)
PROMPT = "1:1 In the beginning"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=2500, help="optimizer steps")
    p.add_argument(
        "--batch-size", type=int, default=8, help="windows per step"
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=256,
        help="window length = longest context",
    )
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument(
        "--n-kv-heads",
        type=int,
        default=None,
        help="fewer than --n-heads: GQA",
    )
    p.add_argument(
        "--lr", type=float, default=3e-3, help="peak learning rate (AdamW)"
    )
    p.add_argument(
        "--warmup", type=int, default=100, help="steps of linear warm-up"
    )
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1611)
    p.add_argument(
        "--threads", type=int, default=2, help="torch.set_num_threads"
    )
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument(
        "--log-every",
        type=int,
        default=25,
        help="progress lines when not on a terminal",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def learning_rate(step: int, args) -> float:
    """Linear warm-up to --lr, then cosine decay to a tenth of it."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Progress:
    """A progress bar without dependencies: redrawn in place on a terminal, one
    line per ``every`` steps in a log file."""

    def __init__(self, total: int, every: int):
        self.total, self.every, self.start = total, every, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, step: int, message: str) -> None:
        done = step + 1
        if not self.tty and done % self.every and done != self.total:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done)
        filled = int(30 * done / self.total)
        line = (
            f"[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} "
            f"{message} "
            f"| {elapsed / done:.2f} s/step | elapsed {elapsed / 60:.1f} min, "
            f"eta {eta / 60:.1f} min"
        )
        print(
            ("\r" + line) if self.tty else line,
            end="" if self.tty else "\n",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def sample(model, tokenizer, temperature: float, seed: int) -> str:
    """A continuation of PROMPT as long as the block allows."""
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    n_new = model.config.context_length - ids.shape[1]
    out = model.generate(ids, n_new, temperature=temperature, seed=seed)
    return tokenizer.decode(out[0].tolist())


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    # the order of training windows
    data_rng = torch.Generator().manual_seed(args.seed)

    text = load_training_text()
    tokenizer = CharTokenizer.from_text(text)
    train, val = train_val_split(torch.tensor(tokenizer.encode(text)))
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size,
        context_length=args.context_length,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        d_model=args.d_model,
    )
    model = TinyGPT(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{len(text):,} characters, vocabulary {tokenizer.vocab_size}; "
        f"train {len(train):,} / val {len(val):,} "
        f"tokens\n{config}\n{n_params:,} parameters; "
        f"{args.steps} steps of {args.batch_size} x {args.context_length} "
        f"tokens; torch {torch.__version__}, "
        f"{args.threads} threads, "
        f"{platform.processor() or platform.machine()}",
        flush=True,
    )

    # the same windows at every evaluation
    eval_rng = torch.Generator().manual_seed(0)
    n_eval = args.eval_batches * args.batch_size
    val_starts = torch.randint(
        len(val) - args.context_length - 1, (n_eval,), generator=eval_rng
    )
    train_eval_starts = torch.randint(
        len(train) - args.context_length - 1, (n_eval,), generator=eval_rng
    )

    # matrices; not biases or LayerNorm gains
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    history = []
    progress = Progress(args.steps, args.log_every)
    start = time.perf_counter()
    # losses since the last progress line
    recent = []
    model.train()
    for step in range(args.steps):
        starts = torch.randint(
            len(train) - args.context_length - 1,
            (args.batch_size,),
            generator=data_rng,
        )
        loss = training_step(
            model,
            optimizer,
            train,
            starts,
            args.context_length,
            learning_rate(step, args),
        )
        recent = recent[-(args.log_every - 1) :] + [loss]
        message = f"loss {sum(recent) / len(recent):.3f}"
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            train_loss = window_loss(
                model,
                train,
                train_eval_starts,
                args.context_length,
                args.batch_size,
            )
            val_loss = window_loss(
                model, val, val_starts, args.context_length, args.batch_size
            )
            history.append(
                {
                    "step": step + 1,
                    "train_loss": round(train_loss, 4),
                    "val_loss": round(val_loss, 4),
                }
            )
            message += f" | eval train {train_loss:.3f} val {val_loss:.3f}"
            if not progress.tty:
                print(
                    f"step {step + 1}: train loss {train_loss:.4f}, val loss "
                    f"{val_loss:.4f}",
                    flush=True,
                )
        progress.update(step, message)
    progress.close()
    seconds = time.perf_counter() - start

    model.eval()
    greedy = sample(model, tokenizer, temperature=0.0, seed=0)
    sampled = sample(model, tokenizer, temperature=0.8, seed=0)
    print(
        f"\ntrained in {seconds / 60:.1f} min; final val loss "
        f"{history[-1]['val_loss']:.4f} nats/char\n"
        f"--- greedy ---\n{greedy}\n--- temperature 0.8, seed 0 ---\n{sampled}"
    )
    meta = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "threads": args.threads,
        "torch": str(torch.__version__),
        "train_minutes": round(seconds / 60, 1),
        "history": history,
        "parameters": n_params,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(args.out, model, tokenizer, meta)
    print(f"saved {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
