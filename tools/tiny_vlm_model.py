"""The built-in tiny VLM in PyTorch (training and export only; the runtime never imports torch).

Three parts, matching the ONNX model contract:
  VisionEncoder   pixel_values [B,3,H,W] → image_features [B,(H/32)*(W/32),D]
  token embedding input_ids [B,S] → inputs_embeds [B,S,D]
  Decoder         inputs_embeds + attention_mask + position_ids + past KV → logits + present KV
The encoder is fully convolutional with resolution-independent 2D positions, so one
set of weights serves every tier and the token count grows with the tier.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TinyVLMConfig:
    vocab_size: int = 64
    dim: int = 192
    layers: int = 4
    heads: int = 4
    ffn_mult: int = 4
    max_positions: int = 320
    patch: int = 32  # tokens = (H/32) * (W/32): stride-16 features, 2x2 pixel-unshuffled

    def to_dict(self) -> dict:
        return asdict(self)


def _conv(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


def sincos_2d(h: int, w: int, dim: int, device=None) -> torch.Tensor:
    """[h*w, dim] positions on normalised coordinates, the same for every tier."""
    ys = (torch.arange(h, device=device, dtype=torch.float32) + 0.5) / h
    xs = (torch.arange(w, device=device, dtype=torch.float32) + 0.5) / w
    yy = ys[:, None] + xs[None, :] * 0  # broadcasting (not expand) keeps ONNX shapes dynamic
    xx = xs[None, :] + ys[:, None] * 0
    quarter = dim // 4
    freqs = torch.exp(torch.arange(quarter, dtype=torch.float32, device=device)
                      * (math.log(64.0) / max(quarter - 1, 1))) * math.pi
    ay = yy.reshape(-1, 1) * freqs[None, :]
    ax = xx.reshape(-1, 1) * freqs[None, :]
    return torch.cat([ay.sin(), ay.cos(), ax.sin(), ax.cos()], dim=1)


class VisionEncoder(nn.Module):
    def __init__(self, cfg: TinyVLMConfig):
        super().__init__()
        self.body = nn.Sequential(
            _conv(3, 24, 2), _conv(24, 48, 2), _conv(48, 48, 1),
            _conv(48, 96, 2), _conv(96, 96, 1),
            _conv(96, 160, 2), _conv(160, 160, 1))
        # 2x2 pixel-unshuffle (as SmolVLM does) keeps stride-16 detail in 4x fewer tokens
        self.proj = nn.Conv2d(160 * 4, cfg.dim, 1)
        self.norm = nn.LayerNorm(cfg.dim)
        self.dim = cfg.dim

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.proj(F.pixel_unshuffle(self.body(pixel_values), 2))  # [B, D, h, w]
        b, d, h, w = x.shape
        x = x.flatten(2).transpose(1, 2)  # [B, h*w, D], row-major like the prompt
        return self.norm(x + sincos_2d(h, w, d, x.device)[None])


class Attention(nn.Module):
    def __init__(self, cfg: TinyVLMConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.dim // cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x, bias, past_k=None, past_v=None):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if past_k is not None:
            k = torch.cat([past_k, k], dim=2)
            v = torch.cat([past_v, v], dim=2)
        att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim)) + bias
        y = att.softmax(-1) @ v  # [B, heads, S, hd]
        return self.out(y.transpose(1, 2).reshape(b, s, -1)), k, v


class Block(nn.Module):
    def __init__(self, cfg: TinyVLMConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn_mult * cfg.dim), nn.GELU(),
                                 nn.Linear(cfg.ffn_mult * cfg.dim, cfg.dim))

    def forward(self, x, bias, past_k=None, past_v=None):
        a, k, v = self.attn(self.ln1(x), bias, past_k, past_v)
        x = x + a
        return x + self.mlp(self.ln2(x)), k, v


class Decoder(nn.Module):
    def __init__(self, cfg: TinyVLMConfig, embed: nn.Embedding):
        super().__init__()
        self.cfg = cfg
        self.pos = nn.Embedding(cfg.max_positions, cfg.dim)
        # as small as the token embeddings: nn.Embedding's default N(0, 1) would drown the
        # words (std 0.02) in position noise and the decoder could not tell "circle" from "square"
        nn.init.normal_(self.pos.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.embed = embed  # tied output head

    @staticmethod
    def attention_bias(attention_mask: torch.Tensor, s: int) -> torch.Tensor:
        """[B,1,S,T] additive bias: causal over absolute positions and the padding mask."""
        t = attention_mask.shape[1]
        q_idx = torch.arange(s, device=attention_mask.device) + (t - s)
        k_idx = torch.arange(t, device=attention_mask.device)
        allowed = (k_idx[None, :] <= q_idx[:, None])[None, None] & (attention_mask[:, None, None, :] > 0)
        return (~allowed).to(torch.float32) * -1e4

    def forward(self, inputs_embeds, attention_mask, position_ids, past=None):
        x = inputs_embeds + self.pos(position_ids)
        bias = self.attention_bias(attention_mask, inputs_embeds.shape[1])
        present = []
        for i, block in enumerate(self.blocks):
            pk, pv = (past[2 * i], past[2 * i + 1]) if past is not None else (None, None)
            x, k, v = block(x, bias, pk, pv)
            present += [k, v]
        logits = self.ln_f(x) @ self.embed.weight.t()
        return logits, present


class TinyVLM(nn.Module):
    def __init__(self, cfg: TinyVLMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.encoder = VisionEncoder(cfg)
        self.decoder = Decoder(cfg, self.embed)

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, image_start: int = 1,
                return_features: bool = False):
        """Training forward: the image block sits at [image_start, image_start + N)."""
        feats = self.encoder(pixel_values)
        n = feats.shape[1]
        emb = self.embed(input_ids)
        x = torch.cat([emb[:, :image_start], feats, emb[:, image_start + n:]], dim=1)
        b, s, _ = x.shape
        mask = torch.ones(b, s, dtype=torch.long, device=x.device)
        pos = torch.arange(s, device=x.device)[None].expand(b, -1)
        logits, _ = self.decoder(x, mask, pos)
        return (logits, feats) if return_features else logits


class AuxHeads(nn.Module):
    """Training-only heads on the image tokens: what is centred in each cell
    (colour, shape kind, the three digits of a label). Not exported."""

    def __init__(self, dim: int, colours: int, kinds: int, digits: int = 11, text_length: int = 3):
        super().__init__()
        self.colour = nn.Linear(dim, colours)
        self.kind = nn.Linear(dim, kinds)
        self.digits = nn.ModuleList(nn.Linear(dim, digits) for _ in range(text_length))

    def loss(self, feats: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy on the cells that hold something (target 0 = nothing is ignored):
        averaged over all cells, the few object cells gave too weak a signal to learn from."""
        heads = [self.colour, self.kind, *self.digits]
        losses = [F.cross_entropy(h(feats).flatten(0, 1), targets[..., i].flatten(), ignore_index=0)
                  for i, h in enumerate(heads) if bool((targets[..., i] > 0).any())]
        return sum(losses) / max(1, len(losses))


# ---- export wrappers: exactly the contract's tensor names ------------------------------

class EmbedTokens(nn.Module):
    def __init__(self, model: TinyVLM):
        super().__init__()
        self.embed = model.embed

    def forward(self, input_ids):
        return self.embed(input_ids)


class MergedDecoder(nn.Module):
    def __init__(self, model: TinyVLM):
        super().__init__()
        self.decoder = model.decoder

    def forward(self, inputs_embeds, attention_mask, position_ids, *past):
        logits, present = self.decoder(inputs_embeds, attention_mask, position_ids, list(past))
        return (logits, *present)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
