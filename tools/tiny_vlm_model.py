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
    learned_positions: bool = False  # a learned absolute table next to RoPE in the decoder (tried; not needed)

    def to_dict(self) -> dict:
        return asdict(self)


TIER_SIDES = (96, 192, 256)  # the tiers' input sides (model.yaml)


class TierBatchNorm(nn.BatchNorm2d):
    """BatchNorm with inference statistics kept per resolution tier.

    Training batches are one tier each and normalise with their own statistics. The
    tiers' statistics differ (a native 256-px scene is noisier than one area-downscaled
    to 128), so one set of running averages serves whichever tiers the last batches
    had: counting at the top tier swung between 40 % and 90 % from one checkpoint to the
    next. After training, `calibrate_tier_norms` measures each tier's statistics and the
    encoder picks them by its input size (nearest tier), inside the exported graph.
    """

    def __init__(self, channels: int, sides: tuple[int, ...] = TIER_SIDES):
        super().__init__(channels)
        self.register_buffer("tier_mean", torch.zeros(len(sides), channels))
        self.register_buffer("tier_var", torch.ones(len(sides), channels))

    def forward(self, x: torch.Tensor, tier: torch.Tensor | None = None) -> torch.Tensor:
        if self.training or tier is None:
            return super().forward(x)
        scale = self.weight / torch.sqrt(self.tier_var[tier] + self.eps)
        shift = self.bias - self.tier_mean[tier] * scale
        return x * scale[None, :, None, None] + shift[None, :, None, None]


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm = TierBatchNorm(cout)

    def forward(self, x: torch.Tensor, tier: torch.Tensor | None = None) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x), tier))


def _conv(cin: int, cout: int, stride: int) -> ConvBlock:
    return ConvBlock(cin, cout, stride)


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
        # nearest tier by input height: computed from the shape, so it lives in the graph
        sides = torch.tensor(TIER_SIDES, dtype=torch.float32, device=pixel_values.device)
        tier = (sides - pixel_values.shape[-2]).abs().argmin()
        x = pixel_values
        for block in self.body:
            x = block(x, tier)
        x = self.proj(F.pixel_unshuffle(x, 2))  # [B, D, h, w]
        b, d, h, w = x.shape
        x = x.flatten(2).transpose(1, 2)  # [B, h*w, D], row-major like the prompt
        return self.norm(x + sincos_2d(h, w, d, x.device)[None])


def rotary(position_ids: torch.Tensor, head_dim: int, base: float = 10000.0):
    """cos, sin [B,1,S,head_dim/2] for rotary positions (RoPE), computed from position_ids
    inside the graph, so the exported decoder takes position_ids like any Llama-style model."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32,
                                      device=position_ids.device) / head_dim)
    angles = position_ids.to(torch.float32)[:, None, :, None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyVLMConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.dim // cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)
        self.record = False  # training only: keep the attention probabilities for a grounding loss
        self.recorded: torch.Tensor | None = None

    def forward(self, x, bias, rope, past_k=None, past_v=None):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)  # the cache holds rotated keys
        if past_k is not None:
            k = torch.cat([past_k, k], dim=2)
            v = torch.cat([past_v, v], dim=2)
        att = ((q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim)) + bias).softmax(-1)
        if self.record:
            self.recorded = att  # [B, heads, S, T]
        y = att @ v  # [B, heads, S, hd]
        return self.out(y.transpose(1, 2).reshape(b, s, -1)), k, v


class Block(nn.Module):
    def __init__(self, cfg: TinyVLMConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn_mult * cfg.dim), nn.GELU(),
                                 nn.Linear(cfg.ffn_mult * cfg.dim, cfg.dim))

    def forward(self, x, bias, rope, past_k=None, past_v=None):
        a, k, v = self.attn(self.ln1(x), bias, rope, past_k, past_v)
        x = x + a
        return x + self.mlp(self.ln2(x)), k, v


class Decoder(nn.Module):
    def __init__(self, cfg: TinyVLMConfig, embed: nn.Embedding):
        super().__init__()
        self.cfg = cfg
        # Rotary positions make attention depend on relative offsets, so the question reads
        # the same whether 16 or 64 image tokens precede it. An optional learned absolute
        # table was tried when counting flipped between tiers; the cause was the encoder's
        # normalisation statistics (TierBatchNorm), and the table is off by default.
        self.pos = nn.Embedding(cfg.max_positions, cfg.dim) if cfg.learned_positions else None
        if self.pos is not None:
            nn.init.normal_(self.pos.weight, std=0.02)  # as small as the token embeddings
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
        x = inputs_embeds if self.pos is None else inputs_embeds + self.pos(position_ids)
        bias = self.attention_bias(attention_mask, inputs_embeds.shape[1])
        rope = rotary(position_ids, self.cfg.dim // self.cfg.heads)
        present = []
        for i, block in enumerate(self.blocks):
            pk, pv = (past[2 * i], past[2 * i + 1]) if past is not None else (None, None)
            x, k, v = block(x, bias, rope, pk, pv)
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

    GROUNDING_LAYER = 1  # the layer whose head 0 the grounding loss teaches where to look

    def forward_shared_prefix(self, pixel_values: torch.Tensor, bos_id: int,
                              suffix_ids: torch.Tensor, owner: torch.Tensor, record: bool = False):
        """Training forward for several questions per image. `<bos> <image>*N` does not depend
        on the question (the decoder is causal), so it runs once per image; each question
        (suffix_ids [Q,S], owner [Q] = its image's row) continues from that prefix's KV.
        The encoder is the costly part, so this gives 3-5x the supervision per step."""
        feats = self.encoder(pixel_values)
        b, n, _ = feats.shape
        bos = self.embed(torch.full((b, 1), bos_id, dtype=torch.long, device=feats.device))
        prefix = torch.cat([bos, feats], dim=1)
        p = prefix.shape[1]
        _, present = self.decoder(prefix, torch.ones(b, p, dtype=torch.long, device=feats.device),
                                  torch.arange(p, device=feats.device)[None].expand(b, -1))
        past = [t.index_select(0, owner) for t in present]
        q, s = suffix_ids.shape
        mask = torch.ones(q, p + s, dtype=torch.long, device=feats.device)
        pos = torch.arange(p, p + s, device=feats.device)[None].expand(q, -1)
        attention = self.decoder.blocks[self.GROUNDING_LAYER].attn
        attention.record = record
        logits, _ = self.decoder(self.embed(suffix_ids), mask, pos, past)
        attention.record = False
        if record:
            return logits, feats, attention.recorded
        return logits, feats


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


@torch.no_grad()
def calibrate_tier_norms(encoder: VisionEncoder, batches_per_tier) -> None:
    """Per-tier inference statistics for every TierBatchNorm: `batches_per_tier` maps a
    tier index to an iterable of pixel_values batches of that tier."""
    norms = [m for m in encoder.modules() if isinstance(m, TierBatchNorm)]
    was_training = encoder.training
    for tier, batches in batches_per_tier.items():
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None  # a plain average over the calibration batches
        encoder.train()
        for pixel_values in batches:
            encoder(pixel_values)
        for norm in norms:
            norm.tier_mean[tier] = norm.running_mean
            norm.tier_var[tier] = norm.running_var
    for norm in norms:
        norm.momentum = 0.1
    encoder.train(was_training)


def load_checkpoint_state(model: nn.Module, state: dict) -> None:
    """Load a state dict, mapping checkpoints from before ConvBlock (Sequential conv/bn/relu:
    body.N.0 / body.N.1) onto it; per-tier statistics then come from calibration."""
    renamed = {}
    for key, value in state.items():
        parts = key.split(".")
        if parts[:2] == ["encoder", "body"] and parts[3] in ("0", "1"):
            parts[3] = "conv" if parts[3] == "0" else "norm"
        renamed[".".join(parts)] = value
    missing, unexpected = model.load_state_dict(renamed, strict=False)
    if unexpected or any(not k.endswith(("tier_mean", "tier_var")) for k in missing):
        raise ValueError(f"checkpoint does not fit: missing {missing}, unexpected {unexpected}")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
