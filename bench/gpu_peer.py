"""The GPU peer: one compiled process decoding a Llama or Qwen3-MoE checkpoint, gpt-fast style, for bench_gpu_mesh.py.

The same shape and dtype as the mesh serves (the HF safetensors directory the benchmark wrote), plain model code, a
static KV cache per batch size, SDPA over it, and the decode step compiled with `torch.compile(mode=
"reduce-overhead")` (CUDA graphs). Its figure is steady decode tokens/s for B sequences decoding together: B times
the decode steps over their time, the prefill excluded. It runs in a process of its own (one CUDA context, freed
before the mesh starts) and prints one JSON line per batch size.

    python bench/gpu_peer.py MODEL_DIR --batches 1,32,128,256 [--prompt-tokens 32] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Attention(nn.Module):
    k_cache: Tensor
    v_cache: Tensor

    def __init__(self, c: dict[str, Any], batch: int, max_seq: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        h = c["hidden_size"]
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        # Qwen3's RMS norms over each head's q and k, before the rope
        self.qk_norm = c.get("model_type", "").startswith("qwen3")
        if self.qk_norm:
            eps = c.get("rms_norm_eps", 1e-6)
            self.q_norm, self.k_norm = nn.RMSNorm(self.head_dim, eps=eps), nn.RMSNorm(self.head_dim, eps=eps)
        shape = (batch, self.kv_heads, max_seq, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, mask: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF Llama's rope (rotate_half), the layout its checkpoints' q and k projections are stored for."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class MLP(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def n_experts(c: dict[str, Any]) -> int:
    """transformers 5 saves Qwen3-MoE's num_experts as num_local_experts; older configs say num_experts."""
    return int(c.get("num_experts") or c.get("num_local_experts") or 0)


class MoE(nn.Module):
    """Qwen3-MoE's sparse block as transformers computes it: router logits, softmax in f32, top-k, renormalised
    (norm_topk_prob), cast back; each chosen expert's SwiGLU weighted by its probability and summed.

    Compile-friendly: no Python branch on the routing (CUDA graphs replay a fixed sequence of kernels). The one
    branch is on the token count, a static shape under torch.compile(dynamic=False), so each batch size compiles
    one path: while the tokens' chosen experts are fewer than all of them (decode at small batches) the chosen
    experts' weights are gathered per token and batch-multiplied, reading only those; from there on every expert
    runs over every token with the routing weights as a mask (zero where not chosen), a dense batched matmul that
    reads each expert once, where gathering would copy tokens x k expert matrices, at least all of them."""

    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        h, f, self.n_experts = c["hidden_size"], c["moe_intermediate_size"], n_experts(c)
        self.top_k, self.norm_topk_prob = c["num_experts_per_tok"], c.get("norm_topk_prob", False)
        self.gate = nn.Linear(h, self.n_experts, bias=False)
        # stacked as transformers' per-expert Linear weights are stored: [E, out, in]
        self.gate_proj = nn.Parameter(torch.empty(self.n_experts, f, h))
        self.up_proj = nn.Parameter(torch.empty(self.n_experts, f, h))
        self.down_proj = nn.Parameter(torch.empty(self.n_experts, h, f))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        weights, experts = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(logits.dtype)
        if x.shape[0] * self.top_k < self.n_experts:
            xs = x[:, None, :, None]  # [T, 1, H, 1] against the gathered [T, k, F, H]
            act = F.silu(self.gate_proj[experts] @ xs) * (self.up_proj[experts] @ xs)
            y = (self.down_proj[experts] @ act).squeeze(-1)  # [T, k, H]
            return (y * weights[..., None]).sum(1).reshape(shape)
        mask = torch.zeros(x.shape[0], self.n_experts, dtype=weights.dtype, device=x.device)
        mask = mask.scatter(1, experts, weights)  # [T, E]
        act = F.silu(x @ self.gate_proj.transpose(1, 2)) * (x @ self.up_proj.transpose(1, 2))  # [E, T, F]
        y = act @ self.down_proj.transpose(1, 2)  # [E, T, H]
        return (y * mask.t()[..., None]).sum(0).reshape(shape)


class Layer(nn.Module):
    def __init__(self, c: dict[str, Any], index: int, batch: int, max_seq: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = c["hidden_size"], c.get("rms_norm_eps", 1e-5)
        self.self_attn = Attention(c, batch, max_seq, dtype)
        sparse = (n_experts(c) > 0 and index not in c.get("mlp_only_layers", [])
                  and (index + 1) % c.get("decoder_sparse_step", 1) == 0)
        self.mlp = MoE(c) if sparse else MLP(h, c["intermediate_size"])
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(h, eps=eps), nn.RMSNorm(h, eps=eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    cos: Tensor
    sin: Tensor
    causal: Tensor

    def __init__(self, c: dict[str, Any], batch: int, max_seq: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c, i, batch, max_seq, dtype) for i in range(c["num_hidden_layers"]))
        self.norm = nn.RMSNorm(c["hidden_size"], eps=c.get("rms_norm_eps", 1e-5))
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        theta = (c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta", 10000.0)
        inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_seq, dtype=torch.float64), inv)
        angles = torch.cat([angles, angles], -1)
        self.register_buffer("cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype), persistent=False)
        self.register_buffer("causal", torch.ones(max_seq, max_seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, ids: Tensor, pos: Tensor) -> Tensor:
        cos, sin, mask = self.cos[pos][None, None], self.sin[pos][None, None], self.causal[pos][None, None]
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, mask)
        return self.lm_head(self.norm(x))


def load(model_dir: Path, batch: int, max_seq: int, dtype: torch.dtype, device: str) -> Decoder:
    from safetensors.torch import load_file

    c = json.loads((model_dir / "config.json").read_text())
    with torch.device(device):
        model = Decoder(c, batch, max_seq, dtype).to(dtype)
    state: dict[str, Tensor] = {}
    experts: dict[str, dict[int, Tensor]] = {}  # a MoE layer's experts as saved, one by one: stacked below
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, t in load_file(str(f), device=device).items():  # HF names -> this module's
            name = name.removeprefix("model.")
            if m := re.fullmatch(r"(layers\.\d+\.mlp)\.experts\.(\d+)\.(\w+)\.weight", name):
                experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = t
            else:
                state[name] = t
    for name, parts in experts.items():
        state[name] = torch.stack([parts[e] for e in range(len(parts))])
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or missing:
        raise SystemExit(f"the checkpoint does not fit the peer model: missing {missing}, unexpected {unexpected}")
    return model.eval()


def greedy(model: Decoder, ids: Tensor, tokens: int) -> Tensor:
    """Eager greedy decode of `tokens` tokens after the prompts `ids` [B, S], one step a token as measure() runs
    them: the peer's tokens, for the CPU check against transformers (tests/test_gpu_peer.py)."""
    with torch.inference_mode():
        out = [model(ids, torch.arange(ids.shape[1], device=ids.device))[:, -1:].argmax(-1)]
        for i in range(tokens - 1):
            out.append(model(out[-1], torch.tensor([ids.shape[1] + i], device=ids.device))[:, -1:].argmax(-1))
    return torch.cat(out, 1)


def measure(model_dir: Path, batch: int, prompt_tokens: int, tokens: int, dtype: torch.dtype, device: str) -> dict[str, Any]:
    max_seq = 1 << math.ceil(math.log2(prompt_tokens + tokens + 1))
    model = load(model_dir, batch, max_seq, dtype, device)
    step = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)
    ids = torch.randint(3, model.lm_head.out_features, (batch, prompt_tokens), device=device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(ids, torch.arange(prompt_tokens, device=device))  # prefill, eager
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        nxt = logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for i in range(3):  # compile and capture
            nxt = step(nxt, torch.tensor([prompt_tokens + i], device=device))[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        decode = tokens - 4
        t0 = time.perf_counter()
        for i in range(3, 3 + decode):
            nxt = step(nxt, torch.tensor([prompt_tokens + i], device=device))[:, -1:].argmax(-1).clone()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    del model, step
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return {"batch": batch, "tok_s": batch * decode / seconds, "step_ms": 1e3 * seconds / decode,
            "prefill_ms": 1e3 * prefill_s, "compile_s": compile_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--batches", default="1,32,128,256")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    for b in [int(x) for x in a.batches.split(",")]:
        print(json.dumps(measure(a.model_dir, b, a.prompt_tokens, a.tokens, dtype, a.device)), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
