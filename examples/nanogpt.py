"""A nanoGPT-style training script ported to scopedlite (docs/migrating.md, "From raw torchrun").

    python examples/nanogpt.py                        # DDP on 2 processes
    python examples/nanogpt.py --strategy fsdp        # or deepspeed_stage_2, ...
    python examples/nanogpt.py --join                 # the same loop inside lite.join

The shape of Karpathy's nanoGPT ``train.py``: a small GPT whose class has methods of its own
(``get_num_params``, ``estimate_mfu``), gradient accumulation, clipping, and a log line with
the model FLOPs utilisation that **rank 0 alone** computes every few iterations. Ported by the
migration guide's recipe:

- ``torchrun`` + ``init_process_group`` + ``DDP(model)`` -> ``with lite.launch(...)`` and
  ``model, optimizer = lite.setup(model, optimizer)``;
- ``model.require_backward_grad_sync = (micro_step == last)`` -> ``lite.no_backward_sync``;
- ``loss.backward()``, ``clip_grad_norm_`` -> ``lite.backward``, ``lite.clip_gradients``;
- ``raw_model = model.module`` -> ``raw_model = model``: the set-up model is your model, and a
  method that runs no forward (``estimate_mfu`` on rank 0) is a plain call that changes no
  collective of any rank.

The data is a synthetic token stream with a simple rule (each token follows from the one
before), so the loss falls within the few iterations the example runs (4.4 to about 2.8).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import scopedlite as lite


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    bias: bool = False  # nanoGPT's option: no bias in Linears and LayerNorms


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "h": nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                "ln_f": nn.LayerNorm(config.n_embd, bias=config.bias),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def get_num_params(self, non_embedding: bool = True) -> int:
        """The number of parameters (a plain count: no forward, nothing communicated)."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Continue ``idx`` by ``max_new_tokens`` tokens (greedy here; nanoGPT samples)."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            idx = torch.cat((idx, logits[:, -1, :].argmax(dim=-1, keepdim=True)), dim=1)
        return idx

    def estimate_mfu(self, fwdbwd_per_iter: int, dt: float) -> float:
        """Model FLOPs utilisation in units of an A100's bfloat16 peak (PaLM paper, appendix B)."""
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        flops_per_token = 6 * self.get_num_params() + 12 * L * H * Q * T
        flops_per_iter = flops_per_token * T * fwdbwd_per_iter
        return flops_per_iter / dt / 312e12


def token_stream(length: int) -> torch.Tensor:
    """Synthetic text: 16 of the 64 tokens, each following from the one before."""
    data = torch.empty(length, dtype=torch.long)
    data[0] = 1
    for i in range(1, length):
        data[i] = (data[i - 1] * 5 + 3) % 16
    return data


def get_batch(
    data: torch.Tensor, generator: torch.Generator, batch_size: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's: random windows of the stream (this rank's generator decides where)."""
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
    return lite.to_device(x), lite.to_device(y)


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor, args: argparse.Namespace
) -> list[float]:
    """nanoGPT's loop, ported; returns the losses rank 0 logged (empty on the other ranks)."""
    run = lite.current()
    master_process = run.is_global_zero
    generator = torch.Generator().manual_seed(1337 + run.global_rank)  # a seed offset per rank
    raw_model = model  # nanoGPT: `model.module if ddp else model`
    logged: list[float] = []
    running_mfu = -1.0
    X, Y = get_batch(data, generator, args.batch_size, args.block_size)
    t0 = time.time()
    for iter_num in range(args.max_iters):
        for micro_step in range(args.gradient_accumulation_steps):
            # nanoGPT: `model.require_backward_grad_sync = (micro_step == last)`
            with lite.no_backward_sync(model, enabled=micro_step < args.gradient_accumulation_steps - 1):
                _, loss = model(X, Y)
                loss = loss / args.gradient_accumulation_steps
                X, Y = get_batch(data, generator, args.batch_size, args.block_size)  # prefetch
                lite.backward(loss)
        if args.grad_clip != 0.0:
            lite.clip_gradients(model, optimizer, max_norm=args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if iter_num % args.log_interval == 0 and master_process:
            lossf = loss.item() * args.gradient_accumulation_steps
            if iter_num >= 5:  # let the training loop settle a bit
                mfu = raw_model.estimate_mfu(args.batch_size * args.gradient_accumulation_steps, dt)
                running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, mfu {running_mfu * 100:.6f}%")
            logged.append(lossf)
    return logged


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--join", action="store_true", help="run the loop inside lite.join(model)")
    parser.add_argument("--max-iters", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=GPTConfig.block_size)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--grad-clip", type=float, default=1.0, help="0: no clipping")
    parser.add_argument("--log-interval", type=int, default=1)
    return parser.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer, the same on every rank (seeded)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.block_size))
    return model, torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95))


def main() -> None:
    args = arguments()
    with lite.launch(strategy=args.strategy, devices=args.devices, accelerator="cpu") as run:
        model, optimizer = build(args)
        model, optimizer = lite.setup(model, optimizer)
        data = token_stream(4000)
        with lite.join(model) if args.join else contextlib.nullcontext():
            losses = train(model, optimizer, data, args)
        if run.is_global_zero:
            print(
                f"{run.world_size} processes, {args.strategy}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                f"perplexity {math.exp(losses[-1]):.2f}"
            )


if __name__ == "__main__":
    main()
