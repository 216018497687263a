"""Tiny Hugging Face models (no download), their data and the one-process reference that the
HF tests compare every strategy with."""

from __future__ import annotations

import torch

N_ITEMS, BATCH, EPOCHS, LR = 9, 2, 2, 1e-2  # 2 ranks: 5 and 4 items, 3 and 2 batches per epoch
SEQ, VOCAB = 12, 96


def quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def config(kind: str):
    from transformers import GPT2Config, LlamaConfig

    if kind == "gpt2":  # dropout off: strategies and ranks then compute the same
        return GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=32,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    return LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def build(kind: str) -> torch.nn.Module:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    return (GPT2LMHeadModel if kind == "gpt2" else LlamaForCausalLM)(config(kind))


def tokens() -> torch.Tensor:
    return torch.randint(1, VOCAB, (N_ITEMS, SEQ), generator=torch.Generator().manual_seed(1))


def prompt() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))


def generate(model: torch.nn.Module) -> list[list[int]]:
    model.eval()
    out = model.generate(prompt(), max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.train()
    return out.tolist()


def reference(kind: str, world_size: int = 2) -> tuple[torch.nn.Module, list[float]]:
    """One process replaying what the strategies compute under lite.join: per epoch and
    step, each rank that still has a batch adds its mean-loss gradient, the sum is divided by
    the world size, AdamW steps. Returns the model and the per-step mean loss over those ranks."""
    quiet()
    torch.manual_seed(0)
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data = tokens()
    per_rank = [
        [
            list(range(r, N_ITEMS, world_size))[i : i + BATCH]
            for i in range(0, len(range(r, N_ITEMS, world_size)), BATCH)
        ]
        for r in range(world_size)
    ]
    losses = []
    for _ in range(EPOCHS):
        for step in range(max(len(b) for b in per_rank)):
            total = [torch.zeros_like(p) for p in model.parameters()]
            step_losses = []
            for batches in per_rank:
                if step < len(batches):
                    model.zero_grad()
                    x = data[batches[step]]
                    loss = model(input_ids=x, labels=x).loss
                    loss.backward()
                    step_losses.append(loss.item())
                    for t, p in zip(total, model.parameters()):
                        if p.grad is not None:
                            t += p.grad
            for t, p in zip(total, model.parameters()):
                p.grad = t / world_size
            opt.step()
            losses.append(sum(step_losses) / len(step_losses))
    return model, losses


class SmallNet(torch.nn.Module):
    """What the torch.compile check compiles (a class of the user's: torch compiles the user's
    forward, not torch's own modules as top frames)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def compile_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def compile_reference(world_size: int) -> SmallNet:
    """Three SGD steps of the uncompiled net, each on the mean of the ranks' mean-loss gradients."""
    torch.manual_seed(0)
    net = SmallNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = compile_data()
    for _ in range(3):
        grads = []
        for rank in range(world_size):
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x[rank::world_size]), y[rank::world_size]).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for p, *gs in zip(net.parameters(), *grads):
            p.grad = sum(gs) / world_size
        opt.step()
    return net
