"""The CPU generation engine: sample replies from a transformers model with a plain KV-cache loop.

`hf_generate(model, tok, prompts, temperature, top_p, max_tokens, turn_cache)` has the call shape of the scripts'
`vllm_generate(llm, tok, prompts, temperature, top_p, max_tokens)` and returns the same thing: one (reply token ids,
their log-probs) pair per prompt, cut after the first stop token. Same sampling rules as vLLM: temperature, top-p,
no top-k, no penalties; the log-probs are those of the tempered distribution, which is what the update recomputes.

Why a loop of our own instead of `model.generate` (docs/CPU.md has the measurements):
  * the members of a group share their prompt, so each distinct prompt is prefilled once and its cache copied;
  * a multi-turn episode's next prompt extends the last one, so `TurnCache` keeps every reply's cache for the next
    turn and only the new observation is prefilled;
  * new keys and values are appended in place (`append_in_place_cache`), not copied at every token;
  * on a CPU, grouped-query attention runs without copying heads (`attention_implementation`), and a bf16 decode
    step uses two matrix products (`decode_attention`) instead of torch's slow bf16 kernel.
The scripts load their models with `attn_implementation=attention_implementation(device)`.
"""

from __future__ import annotations

import torch


def stop_token_ids(tok) -> list[int]:
    """Token ids that end a reply: Qwen's <|im_end|> and <|endoftext|>, plus the tokenizer's eos."""
    ids = {tok.eos_token_id} | {
        tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>") if t in tok.get_vocab()
    }
    return sorted(i for i in ids if i is not None)


def cut_at_stop(ids: list[int], logps: list[float], stops: list[int]) -> tuple[list[int], list[float]]:
    """Keep tokens up to and including the first stop token (the model emitted it, so it is trained too)."""
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1], logps[: i + 1]
    return ids, logps


def top_p_filter(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p. z: (B, V) logits."""
    if top_p >= 1.0:
        return z
    sorted_z, order = z.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_z.softmax(-1)  # (B, V)
    drop = probs.cumsum(-1) - probs > top_p  # (B, V): the mass before this token already reached top_p
    return z.scatter(-1, order, sorted_z.masked_fill(drop, float("-inf")))


def members(seeds: list[int]) -> list[int]:
    """Each episode's number within its group: the i-th episode of a seed is member i."""
    out, seen = [], {}
    for s in seeds:
        out.append(seen.get(s, 0))
        seen[s] = out[-1] + 1
    return out


def request_seeds(seeds: list[int], turn: int = 1) -> list[int]:
    """One sampling seed per episode and turn, from its environment seed, its member number and the turn: the same
    wherever the episode is played, whatever the number of processes (--request-seeds)."""
    return [((s * 1_000_003 + m) * 1_000_003 + turn) % 2**63 for s, m in zip(seeds, members(seeds))]


def sample(probs: torch.Tensor, generators=None) -> torch.Tensor:
    """One token per row of probs (b, V): torch's own RNG, or (generators: one per row) each row's own stream, by
    inverting its cumulative distribution at one uniform draw."""
    if generators is None:
        return torch.multinomial(probs, 1).squeeze(-1)
    u = torch.stack([torch.rand((), generator=g, device=g.device) for g in generators])  # (b,)
    cdf = probs.cumsum(-1)  # (b, V)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


@torch.no_grad()
def hf_generate(model, tok, prompts, temperature, top_p, max_tokens, turn_cache=None, batch_size=256, seeds=None):
    """Sample one reply per prompt with a plain KV-cache loop. Returns [(reply token ids, their log-probs)].

    Same rules as vLLM here: temperature, top-p, no top-k, no penalties. Why not model.generate? Members of a
    group share their prompt, so we prefill each distinct prompt once and copy its KV cache to the group: the
    prompt is most of the compute on a CPU (the bandit's 8 x 8 batch has 8 distinct prompts). The log-probs are
    those of the tempered distribution, which is what the update pass recomputes.

    turn_cache (multi-turn rollouts; a TurnCache): a prompt that extends one of the previous call's
    prompt + reply prefills only its new tokens (the observation) on top of the stored cache, instead of the whole
    episode again, and every reply's cache is stored for the next call. Each row's past is left-padded to the
    longest, and its new tokens are left-padded after it: the padding in between is masked and skipped by the
    position ids, so the sampled tokens and log-probs are those of a full re-prefill.

    seeds (--request-seeds; one per prompt): each row samples from its own generator, so a reply does not depend on
    which other prompts share its batch (several processes, a resume on another count); None: torch's RNG.
    """
    stops = torch.tensor(stop_token_ids(tok))
    device = next(model.parameters()).device
    results = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        distinct = list(dict.fromkeys(tuple(p) for p in chunk))
        row = torch.tensor(
            [distinct.index(tuple(p)) for p in chunk], device=device
        )  # (b,): chunk row -> distinct prompt
        take = turn_cache.take if turn_cache is not None else (lambda p: (0, None))
        pasts = [take(list(p)) for p in distinct]  # (stored length, per-layer keys and values) per distinct prompt
        fresh = [p[n:] for p, (n, _) in zip(distinct, pasts)]  # the tokens to prefill now
        width = max(len(p) for p in fresh)
        stored = any(n for n, _ in pasts)  # then the prefill's `width` new tokens go into the cache's buffer too
        cache, past_attn = cache_from_rows(pasts, device, room=max_tokens + (width if stored else 0))  # (u, C)
        del pasts  # the stored pasts are in the batch's cache now: the last chunk lets the turn cache drop them
        if turn_cache is not None and i + batch_size >= len(prompts):
            turn_cache.release()
        input_ids = torch.full((len(distinct), width), tok.pad_token_id, device=device)  # (u, P), left-padded
        attn = torch.zeros((len(distinct), width), dtype=torch.long, device=device)  # (u, P)
        for j, p in enumerate(fresh):
            input_ids[j, width - len(p) :] = torch.tensor(p)
            attn[j, width - len(p) :] = 1
        attn = torch.cat([past_attn, attn], dim=1)  # (u, C + P)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)[:, -width:]  # (u, P): padding must not shift positions
        out = model(
            input_ids=input_ids,
            attention_mask=attn,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        if len(distinct) < len(chunk):  # (u, ...) -> (b, ...): every member of a group gets its prompt's cache
            cache.batch_select_indices(row)
        logits, attn, pos = out.logits[row, -1], attn[row], positions[row, -1:]  # (b, V), (b, C + P), (b, 1)
        prompt_cols = attn.shape[1]
        tokens, logps = [], []
        done = torch.zeros(len(chunk), dtype=torch.bool, device=device)  # (b,)
        gens = None if seeds is None else [torch.Generator(device).manual_seed(s) for s in seeds[i : i + batch_size]]
        for _ in range(max_tokens):
            logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # (b, V)
            nxt = sample(top_p_filter(logp_all, top_p).exp(), gens)  # (b,)
            nxt = nxt.masked_fill(done, tok.pad_token_id)  # finished rows only pad
            tokens.append(nxt)
            logps.append(logp_all.gather(-1, nxt[:, None]).squeeze(-1))
            done |= torch.isin(nxt, stops.to(device))
            if done.all():
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)  # (b, C + P + t)
            pos = pos + 1
            out = model(
                input_ids=nxt[:, None], attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True
            )
            logits = out.logits[:, -1]  # (b, V)
        new, new_logps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()  # (b, R)
        replies = [cut_at_stop(ids, lps, stops.tolist()) for ids, lps in zip(new, new_logps)]
        for k, (ids, _) in enumerate(replies if turn_cache is not None else []):
            # the cache holds the prompt and every reply token but the last (sampled, never fed back)
            fed = prompt_cols + torch.arange(len(ids) - 1, device=device)  # (len(ids) - 1,)
            cols = torch.cat([attn[k, :prompt_cols].nonzero().squeeze(-1), fed])
            turn_cache.put(list(chunk[k]) + ids[:-1], cache_row(cache, k, cols))
        results += replies
    if turn_cache is not None:
        turn_cache.commit()
    return results


def append_in_place_cache(room: int | None = None):
    """A transformers DynamicCache whose layers append each new token in place, into a buffer with room to spare.

    transformers' DynamicLayer appends with torch.cat, which copies the whole cache at every generated token; on the
    bandit's 32-reply batch that copy was 55% of generation time (torch.profiler, CPU). Here a layer copies only
    when its buffer is full, and `keys` / `values` stay what transformers reads: the filled part, as a view. Any
    other change to them (batch_select_indices) is noticed and starts a new buffer. A new buffer has room for `room`
    more tokens (hf_generate: the prompt's new tokens and the reply budget, so it never grows mid-reply), or None:
    as many as it holds (doubling). Used for generation only.
    """
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

    class AppendInPlace(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = self.get_seq_length()
            new = n + key_states.shape[-2]
            buf = getattr(self, "buffers", None)
            if buf is None or self.keys.data_ptr() != buf[0].data_ptr() or new > buf[0].shape[-2] or n == 0:
                old = (self.keys, self.values) if n else (key_states[..., :0, :], value_states[..., :0, :])
                size = new + (new if room is None else max(room, 1))
                buf = tuple(x.new_empty(*x.shape[:-2], size, x.shape[-1]) for x in (key_states, value_states))
                for b, o in zip(buf, old):
                    b[..., :n, :] = o
                self.buffers = buf
            buf[0][..., n:new, :], buf[1][..., n:new, :] = key_states, value_states
            self.keys, self.values = buf[0][..., :new, :], buf[1][..., :new, :]
            return self.keys, self.values

    cache = DynamicCache()
    Cache.__init__(cache, layer_class_to_replicate=AppendInPlace)
    return cache


def decode_attention(query, key, value, mask=None, scale=None) -> torch.Tensor:
    """Attention of one new token per row over its KV cache, as two batched matrix products with grouped-query heads.

    query (B, H, 1, d); key, value (B, K, L, d) with H a multiple of K; mask (B or 1, 1, 1, L) bool, True = attend,
    or None. Returns (B, H, 1, d); the scores and their softmax are float32. Used for bf16 decode steps on a CPU:
    there torch's flash kernel (scaled_dot_product_attention) took 4.6-10.6 ms for one step of 64 rows x 300-700
    cached tokens, this 0.8-2.1 ms (float32's kernel: 1.0-2.2 ms; bench/decode_attention.py). The keys and values are views into append_in_place_cache's
    bigger buffer, and a bf16 matrix product copies such a view into a contiguous block first (what is left of a bf16
    rollout is mostly those copies); key @ q measured faster than q @ key^T here.
    """
    b, h, _, d = query.shape
    k = key.shape[1]
    q = query.reshape(b, k, h // k, d)  # (B, K, g, d): the g query heads that share key/value head K
    scores = (key @ q.transpose(-1, -2)).transpose(-1, -2).float()  # (B, K, g, L)
    scores = scores * (d**-0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~mask.reshape(mask.shape[0], 1, 1, -1), float("-inf"))  # (B or 1, 1, 1, L)
    return (scores.softmax(-1).to(value.dtype) @ value).reshape(b, h, 1, d)  # (B, H, 1, d)


def _sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention, with grouped-query attention left to torch (enable_gqa) instead of repeat_kv.

    A bf16 (or fp16) decode step goes to decode_attention instead: torch's CPU kernel is 2.4-5x slower there."""
    decode = query.shape[2] == 1 and query.dtype != torch.float32 and dropout == 0.0
    if decode and (attention_mask is None or attention_mask.dtype == torch.bool):
        out = decode_attention(query, key, value, attention_mask, scaling)  # (B, H, 1, d)
        return out.transpose(1, 2).contiguous(), None
    is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    groups = getattr(module, "num_key_value_groups", 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=groups > 1,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def attention_implementation(device: str) -> str:
    """The attention the scripts load their models with (attn_implementation=): "sdpa_gqa" on a CPU, else "sdpa".

    With a padding mask, transformers' sdpa copies every key/value head once per query head (repeat_kv) in every
    layer at every step; in a decode step that copy is the whole KV cache. On a CPU torch's own grouped-query
    attention (enable_gqa) needs no copy: one tiny-model decode step's attention (64 episodes x 500 tokens) took
    5.5 ms instead of 35 ms. On CUDA torch would fall back to its slow math kernel with a mask, so "sdpa" stays.
    """
    if device != "cpu":
        return "sdpa"
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register("sdpa_gqa", _sdpa_gqa)
    AttentionMaskInterface.register("sdpa_gqa", sdpa_mask)  # the same boolean masks sdpa gets
    return "sdpa_gqa"


class TurnCache:
    """Each live episode's KV cache from one turn to the next of a multi-turn rollout (hf backend).

    A turn's prompt is the previous turn's prompt + its reply + the new observation, so hf_generate needs to prefill
    only the observation: it stores every reply's cache here (`put`) and looks a prompt up before prefilling it
    (`take`: the longest stored token sequence that is a strict prefix of the prompt). The cache stays exact: the
    keys and values are those the model computed for the same tokens at the same positions. One rollout owns one
    TurnCache, so a cache never outlives the weights that made it. What one generate call stores replaces
    everything stored before (`commit`): only the episodes that just got a reply can continue. With
    --max-context-turns the prompt drops old turns and is no longer an extension: it misses and is prefilled whole.
    """

    TAIL = 8  # entries are found by (length, last TAIL ids), then compared in full

    def __init__(self):
        self.entries: dict = {}  # (len, tail) -> [(ids, [(keys, values) per layer])]
        self.pending: dict = {}  # what the current generate call stores
        self.hits = self.misses = 0  # prompts continued from a stored cache / prefilled whole

    def take(self, prompt: list[int]) -> tuple[int, list | None]:
        """(c, per-layer [(K (heads, c, d), V)]) for the longest stored strict prefix of prompt, or (0, None)."""
        for n in sorted({n for n, _ in self.entries if n < len(prompt)}, reverse=True):
            for ids, kv in self.entries.get((n, tuple(prompt[max(0, n - self.TAIL) : n])), ()):
                if prompt[:n] == ids:
                    self.hits += 1
                    return n, kv
        self.misses += 1
        return 0, None

    def put(self, ids: list[int], kv: list) -> None:
        """Store the cache of `ids` (kv: per layer (K (heads, len(ids), d), V)) for the next call."""
        self.pending.setdefault((len(ids), tuple(ids[-self.TAIL :])), []).append((list(ids), kv))

    def release(self) -> None:
        """Forget what the previous call stored, once the current call has taken what it needs (memory: those pasts
        are in the batch's cache by then)."""
        self.entries = {}

    def commit(self) -> None:
        self.entries, self.pending = self.pending, {}


def cache_from_rows(
    rows: list[tuple[int, list | None]], device, room: int | None = None
) -> tuple[object, torch.Tensor]:
    """A generation cache holding each row's stored past, left-padded to the longest: (cache, past mask (u, W)).

    rows: what TurnCache.take returned for each prompt of the batch ((0, None) where nothing was stored). Padding
    columns are zeros, masked out. W == 0 (no row has a past) gives an empty cache. room: append_in_place_cache's.
    """
    width = max(n for n, _ in rows)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)  # (u, W)
    cache = append_in_place_cache(room)
    if width == 0:
        return cache, mask
    some = next(kv for _, kv in rows if kv is not None)
    for layer, (k0, v0) in enumerate(some):
        keys = k0.new_zeros((len(rows), k0.shape[0], width, k0.shape[-1]))  # (u, heads, W, d)
        values = v0.new_zeros((len(rows), v0.shape[0], width, v0.shape[-1]))
        for j, (n, kv) in enumerate(rows):
            if kv is not None:
                keys[j, :, width - n :], values[j, :, width - n :] = kv[layer]
        cache.update(keys, values, layer)
    for j, (n, _) in enumerate(rows):
        mask[j, width - n :] = 1
    return cache, mask


def cache_row(cache, row: int, columns: torch.Tensor) -> list:
    """One row's keys and values at the given cache columns, per layer: [(K (heads, len(columns), d), V)].

    Indexing with a tensor copies, so the row no longer holds the batch's buffers alive."""
    return [(layer.keys[row][:, columns], layer.values[row][:, columns]) for layer in cache.layers]
