"""Split learning: the client keeps the embedding, the first k blocks and its data; the PS runs the rest.

One training step, as three pure calls (the service carries `CutForward` up and `CutBackward` down):

    cut = client.forward(x)            # activations at the cut (B, T, C), and the tied embedding weight
    back = server.step(cut, y)         # loss, dL/d(activations), dL/d(lm_head weight), server grad norm²
    coef = client.backward(back)       # client backward, global-norm clip, client AdamW step
    server.apply(coef)                 # server AdamW step with the same clip coefficient

It reproduces plain training: the same forward ops, global-norm clipping over both halves (the norms meet
on the client; the coefficient travels back, e.g. with the next step's activations), and a tied lm_head
kept exact: the client owns the tied weight and its AdamW state, sends the weight with the activations
(the server's head is a mirror) and adds the head's gradient, returned by the server, to its embedding's.
That costs vocab·n_embd floats each way per step; untied models send nothing extra.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cleave.errors import ConfigError
from cleave.models.llama import rope_tables

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


class ClientHalf(nn.Module):
    """Token embedding (and GPT-2's positions) plus the first k blocks of a model; copies, not views."""

    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__()
        self.config = cfg = model.config
        if cfg.family == "gpt2":
            self.embed = copy.deepcopy(model.transformer.wte)
            self.wpe = copy.deepcopy(model.transformer.wpe)
            blocks = model.transformer.h
        else:
            self.embed = copy.deepcopy(model.embed_tokens)
            blocks = model.layers
        self.blocks = nn.ModuleList(copy.deepcopy(b) for b in blocks[:k])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> activations at the cut (B, T, C)."""
        T = idx.size(1)
        if self.config.family == "gpt2":
            x = self.embed(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
            for block in self.blocks:
                x = block(x)
            return x
        cos, sin = rope_tables(self.config, T, idx.device)
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return x


class ServerHalf(nn.Module):
    """Blocks k.. , the final norm and lm_head (its own copy of the weight, even when the model ties it)."""

    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__()
        self.config = cfg = model.config
        blocks, norm = (
            (model.transformer.h, model.transformer.ln_f)
            if cfg.family == "gpt2"
            else (model.layers, model.norm)
        )
        self.blocks = nn.ModuleList(copy.deepcopy(b) for b in blocks[k:])
        self.norm = copy.deepcopy(norm)
        self.lm_head = copy.deepcopy(model.lm_head)  # a module copied alone gets its own weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Activations at the cut (B, T, C) -> logits (B, T, vocab)."""
        if self.config.family == "gpt2":
            for block in self.blocks:
                x = block(x)
        else:
            cos, sin = rope_tables(self.config, x.size(1), x.device)
            for block in self.blocks:
                x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def split_model(model: nn.Module, k: int) -> tuple[ClientHalf, ServerHalf]:
    """Cut a `cleave.models.build_model` model after its k-th block (0 <= k <= n_layer)."""
    n = model.config.n_layer
    if not 0 <= k <= n:
        raise ConfigError(f"split_layers={k} must be between 0 and the model's n_layer={n}")
    return ClientHalf(model, k), ServerHalf(model, k)


@dataclass(frozen=True)
class CutForward:
    """Client -> server, once per step."""

    activations: torch.Tensor  # (B, T, C) at the cut
    tied_weight: torch.Tensor | None = None  # the client's embedding weight (vocab, C) when lm_head is tied


@dataclass(frozen=True)
class CutBackward:
    """Server -> client, once per step."""

    loss: float
    grad: torch.Tensor  # dL/d activations (B, T, C)
    tied_grad: torch.Tensor | None = None  # dL/d lm_head weight, when tied
    grad_sq_norm: float = 0.0  # sum of the server's squared gradient norms (the tied weight left out)


def _sq_norm(params: list[nn.Parameter]) -> float:
    return sum(float(torch.linalg.vector_norm(p.grad, 2).double() ** 2) for p in params if p.grad is not None)


def clip_coefficient(total_sq_norm: float, max_norm: float) -> float:
    """What torch.nn.utils.clip_grad_norm_ multiplies every gradient by (1.0 when clipping is off)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (math.sqrt(total_sq_norm) + CLIP_EPS))


@torch.no_grad()
def _scale(params: list[nn.Parameter], coef: float) -> None:
    if coef != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


class SplitClient:
    def __init__(self, half: ClientHalf, opt: torch.optim.Optimizer, grad_clip: float = 0.0) -> None:
        self.half, self.opt, self.grad_clip = half, opt, grad_clip
        self.tied = half.config.tie_embeddings
        self._out: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> CutForward:
        self.half.train()
        self._out = self.half(x)
        tied = self.half.embed.weight.detach().clone() if self.tied else None
        return CutForward(self._out.detach(), tied)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor) -> CutForward:
        """The cut of a validation batch in eval mode; nothing is kept for a backward."""
        self.half.eval()
        tied = self.half.embed.weight.detach().clone() if self.tied else None
        return CutForward(self.half(x), tied)

    def backward(self, back: CutBackward) -> float:
        """Finish the step on the client; the clip coefficient the server must apply too."""
        if self._out is None:
            raise RuntimeError("backward without a forward")
        if back.grad.shape != self._out.shape:
            raise ValueError(
                f"cut gradient of shape {tuple(back.grad.shape)} for activations {tuple(self._out.shape)}"
            )
        if not bool(torch.isfinite(back.grad).all()):
            raise FloatingPointError("the gradient at the cut is not finite")
        self.opt.zero_grad(set_to_none=True)
        self._out.backward(back.grad)
        self._out = None
        if back.tied_grad is not None:
            self.half.embed.weight.grad.add_(back.tied_grad)
        params = list(self.half.parameters())
        coef = clip_coefficient(_sq_norm(params) + back.grad_sq_norm, self.grad_clip)
        _scale(params, coef)
        self.opt.step()
        return coef


class SplitServer:
    def __init__(self, half: ServerHalf, opt: torch.optim.Optimizer) -> None:
        """`opt` over `server_params(half)`: with a tied head, the client owns (and steps) that weight."""
        self.half, self.opt = half, opt
        self.tied = half.config.tie_embeddings

    def step(self, cut: CutForward, y: torch.Tensor) -> CutBackward:
        if self.tied:
            if cut.tied_weight is None or cut.tied_weight.shape != self.half.lm_head.weight.shape:
                raise ValueError("a tied model needs the client's embedding weight with every cut")
            with torch.no_grad():
                self.half.lm_head.weight.copy_(cut.tied_weight)
        self.half.train()
        act = cut.activations.detach().requires_grad_(True)
        logits = self.half(act)  # (B, T, vocab)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.opt.zero_grad(set_to_none=True)
        self.half.lm_head.weight.grad = None
        loss.backward()
        tied_grad = self.half.lm_head.weight.grad if self.tied else None
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"loss is {value}")
        if not bool(torch.isfinite(act.grad).all()):  # (the client would refuse it: the step cannot be finished)
            raise FloatingPointError(f"loss is {value:.4g}, and the gradient at the cut is not finite")
        return CutBackward(value, act.grad, tied_grad, _sq_norm(server_params(self.half)))

    @torch.no_grad()
    def evaluate(self, cut: CutForward, y: torch.Tensor) -> float:
        """The loss of the whole model on a validation cut (eval mode, the client's current tied weight)."""
        if self.tied and cut.tied_weight is not None:
            self.half.lm_head.weight.copy_(cut.tied_weight)
        self.half.eval()
        logits = self.half(cut.activations)  # (B, T, vocab)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).item()

    def apply(self, coef: float) -> None:
        _scale(server_params(self.half), coef)
        self.opt.step()


def server_params(half: ServerHalf) -> list[nn.Parameter]:
    """The parameters the server trains: all but a tied lm_head weight."""
    skip = half.lm_head.weight if half.config.tie_embeddings else None
    return [p for p in half.parameters() if p is not skip]
