"""The update's forward pass, made cheap for multi-turn rows: each group's first prompt runs once, and micro-batches
gather rows of like length (docs/CPU.md). Same numbers as the plain pass over full rows (tests/test_sokoban.py).
Also the collapse diagnostics' cross-scoring pass, each prompt run once for every reasoning (test_ragen2_maths.py)."""

from __future__ import annotations

import copy
import math

import torch


def hidden_states(body, mb: dict) -> torch.Tensor:
    """The last hidden states of mb's rows, (b, L, H), with each group's first prompt run once.

    Every row starts with its trajectory's first prompt and the rows of a group share it, so the distinct prompts
    run once (u rows, cut at the longest, F), their KV cache is copied to the rows (an index: gradients from every
    row flow back into the one prompt pass), and each row's rest runs on top at its own positions (the padding in
    between masked). The states then go back to the rows' own columns: the same numbers as one pass over the full
    rows (tested, values and gradients), for u * F + b * R tokens instead of b * (F + R).
    """
    from transformers import DynamicCache

    groups = mb["group"].tolist()
    distinct = list(dict.fromkeys(groups))
    lead = torch.tensor([groups.index(g) for g in distinct], device=mb["group"].device)  # (u,): a row per group
    row = torch.tensor([distinct.index(g) for g in groups], device=lead.device)  # (b,): row -> its group's prompt
    first, length = mb["first_len"], mb["length"]  # (b,) each
    F, R = int(first.max()), int((length - first).max())
    cols = torch.arange(F, device=lead.device)
    prompt_attn = (cols[None] < first[lead, None]).long()  # (u, F): a shorter prompt's tail is masked
    cache = DynamicCache()
    out = body(
        input_ids=mb["input_ids"][lead, :F],
        attention_mask=prompt_attn,
        position_ids=cols[None].expand(len(lead), -1),
        past_key_values=cache,
        use_cache=True,
    )
    h = out.last_hidden_state[row]  # (b, F, H)
    if R > 0:
        rest = first[:, None] + torch.arange(R, device=lead.device)[None]  # (b, R): each row's columns after it
        rest_attn = (rest < length[:, None]).long()  # (b, R): right padding
        cache.batch_select_indices(row)  # (u, ...) -> (b, ...)
        out = body(
            input_ids=mb["input_ids"].gather(1, rest.clamp(max=mb["input_ids"].shape[1] - 1)),
            attention_mask=torch.cat([prompt_attn[row], rest_attn], dim=1),  # (b, F + R)
            position_ids=rest,
            past_key_values=cache,
            use_cache=True,
        )
        h = torch.cat([h, out.last_hidden_state], dim=1)  # (b, F + R, H)
    L = mb["input_ids"].shape[1]
    t = torch.arange(L, device=lead.device)[None]  # (1, L)
    where = torch.where(t < first[:, None], t, F + t - first[:, None]).clamp(max=h.shape[1] - 1)  # (b, L)
    return h.gather(1, where[..., None].expand(-1, -1, h.shape[-1]))  # (b, L, H); padding columns: any state


def padded_tokens(plan: list[torch.Tensor], first_len, rest_len, group) -> int:
    """The tokens a plan's micro-batches run: each distinct first prompt once, every row padded to its micro-batch's
    longest rest (micro_batch_plan's cost, less its fixed cost per pass)."""
    first, rest, groups = (torch.as_tensor(x).tolist() for x in (first_len, rest_len, group))
    return sum(
        len({groups[i] for i in p.tolist()}) * max(first[i] for i in p.tolist())
        + len(p) * max(rest[i] for i in p.tolist())
        for p in plan
    )


def micro_batch_plan(first_len, rest_len, group, max_rows: int, overhead: int = 64) -> list[torch.Tensor]:
    """Cut rows into micro-batches of at most max_rows that pad the fewest tokens. Returns index tensors into the
    given rows (every row exactly once; each micro-batch's rows in group order).

    A micro-batch runs each distinct first prompt once and pads every row's rest to its longest, so it costs
    (distinct groups) x (longest first prompt) + rows x (longest rest) tokens, plus `overhead` tokens' worth of fixed
    cost per pass. Multi-turn rest lengths are ragged (one turn played or five: 40 to 570 tokens on the tiny
    FrozenLake), and one micro-batch of them is mostly padding (2-3x the real tokens). Rows sorted by rest length
    are cut into contiguous runs by dynamic programming: the cheapest cut of that order. The gradient is the same
    (micro_batch_weight makes any split add up to the mini-batch loss); only the float summation order changes.
    first_len, rest_len, group: (n,) each, tensors or lists.
    """
    first, rest, groups = (torch.as_tensor(x).tolist() for x in (first_len, rest_len, group))
    order = sorted(range(len(rest)), key=lambda i: (rest[i], groups[i]))
    best, cut = [0.0] + [math.inf] * len(order), [0] * (len(order) + 1)  # best[j]: cheapest plan of order[:j]
    for j in range(1, len(order) + 1):
        seen, longest_first = set(), 0
        for i in range(j - 1, max(j - max_rows, 0) - 1, -1):  # the last micro-batch is order[i:j]
            seen.add(groups[order[i]])
            longest_first = max(longest_first, first[order[i]])
            cost = best[i] + len(seen) * longest_first + (j - i) * rest[order[j - 1]] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    plan, j = [], len(order)
    while j > 0:
        rows = sorted(order[cut[j] : j], key=lambda i: (groups[i], i))
        plan.append(torch.tensor(rows, dtype=torch.long))
        j = cut[j]
    return plan[::-1]


def reply_outputs(model, mb: dict, field: str, **kw) -> torch.Tensor:
    """The bandit's update pass: the model's outputs at the positions that predict each reply token, (b, r, ...),
    for a micro-batch of left-padded prompts (u distinct ones) and right-padded replies (starpo_bandit.micro_view).

    Position t predicts reply token t: the prompt's last position for t = 0, then reply tokens 0..r-2. Why two calls?
    The rows of a group share their prompt, and the prompt is most of the sequence (the bandit: ~180 prompt tokens,
    ~25 reply tokens). So each distinct prompt runs once, its KV cache is copied to its rows (an index, so gradients
    from every row flow back into the one prompt pass), and the replies run on top: a group of 8 costs one prompt
    instead of eight, in the log-prob pass and in the backward pass. Same numbers as one full-sequence pass, tested.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(
        input_ids=mb["prompt_ids"],
        attention_mask=mb["prompt_attn"],
        position_ids=mb["prompt_pos"],
        past_key_values=cache,
        use_cache=True,
        **kw,
    )
    parts = [getattr(out, field)[mb["row"], -1:]]  # (b, 1, ...): each row's prompt end predicts reply token 0
    if mb["r1"] > 1:
        cache.batch_select_indices(mb["row"])  # (u, ...) -> (b, ...)
        attn = torch.cat([mb["prompt_attn"][mb["row"]], torch.ones_like(mb["reply_in"])], dim=1)  # (b, p + r - 1)
        out = model(
            input_ids=mb["reply_in"],
            attention_mask=attn,
            position_ids=mb["reply_pos"],
            past_key_values=cache,
            use_cache=True,
        )
        parts.append(getattr(out, field))  # (b, r - 1, ...); right padding is causal-invisible to real tokens
    return torch.cat(parts, dim=1)


def cross_logprobs(model, prompts: list[list[int]], thinks: list[list[int]], temperature: float = 1.0, batch_size=64):
    """RAGEN-2's cross-scoring matrices for the collapse diagnostics (collapse_metrics.py L455-558): log p(z_i | x_j)
    of every reasoning z_i (its sampled token ids) after every prompt x_j (token ids up to where z's tokens start),
    teacher-forced under logits / temperature, as the per-token mean and the sum over z_i's tokens: two (R, N)
    float64 tensors on the CPU, no gradient.

    RAGEN runs N passes of R full [x_j | z_i] rows. Here each prompt runs once and its KV cache is copied to chunks
    of at most batch_size reasonings (right-padded, attention 0 on the padding), which run on top at their own
    positions: N prompts + N * R reasonings' tokens instead of N * R * (prompt + reasoning). The chunks gather
    reasonings of like length (micro_batch_plan), so little of it is padding: think lengths are ragged (5 to 40
    tokens on the tiny bandit). Only the real tokens go through the output head, so batch_size bounds the memory.
    Empty reasonings or prompts are the caller's to leave out (an error here). Call it in eval mode (dropout off), as for the old log-probs.
    """
    from transformers import DynamicCache

    if not prompts or not thinks or min(map(len, prompts)) == 0 or min(map(len, thinks)) == 0:
        raise ValueError("cross_logprobs needs non-empty prompts and reasonings (leave the empty ones out)")
    body, head = model.base_model, model.get_output_embeddings()
    device = next(model.parameters()).device
    lengths = torch.tensor([len(z) for z in thinks], device=device)  # (R,)
    ids = torch.zeros(len(thinks), int(lengths.max()), dtype=torch.long, device=device)  # (R, L): right-padded
    for i, z in enumerate(thinks):
        ids[i, : len(z)] = torch.tensor(z, device=device)
    real = torch.arange(ids.shape[1], device=device)[None] < lengths[:, None]  # (R, L)
    mean = torch.zeros(len(thinks), len(prompts), dtype=torch.float64)  # (R, N)
    total = torch.zeros_like(mean)  # (R, N)
    lens = lengths.tolist()
    plan = [idx.to(device) for idx in micro_batch_plan([0] * len(lens), lens, [0] * len(lens), batch_size)]
    with torch.no_grad():
        for j, x in enumerate(prompts):
            P = len(x)
            cache = DynamicCache()
            out = body(
                input_ids=torch.tensor([x], device=device),
                position_ids=torch.arange(P, device=device)[None],
                past_key_values=cache,
                use_cache=True,
            )
            last = out.last_hidden_state[:, -1:]  # (1, 1, H): the prompt's end predicts every z's first token
            for idx in plan:
                z, keep = ids[idx], real[idx]  # (b, L) each: a chunk of like-length reasonings
                b, L = int(z.shape[0]), int(keep.sum(1).max())
                z, keep = z[:, :L], keep[:, :L]  # (b, L): cut at this chunk's longest
                h = last.expand(b, 1, -1)  # (b, 1, H)
                if L > 1:  # tokens 0..L-2 predict tokens 1..L-1, on top of a copy of the prompt's cache
                    rows = copy.deepcopy(cache)  # a fresh copy per chunk: the pass appends its tokens to its cache
                    rows.batch_select_indices(torch.zeros(b, dtype=torch.long, device=device))  # (1, ...) -> (b, ...)
                    prompt_attn = torch.ones(b, P, dtype=torch.long, device=device)  # (b, P)
                    out = body(
                        input_ids=z[:, :-1],
                        attention_mask=torch.cat([prompt_attn, keep[:, :-1].long()], dim=1),  # (b, P + L - 1)
                        position_ids=P + torch.arange(L - 1, device=device)[None].expand(b, -1),  # (b, L - 1)
                        past_key_values=rows,
                        use_cache=True,
                    )
                    h = torch.cat([h, out.last_hidden_state], dim=1)  # (b, L, H)
                logits = head(h[keep]).float() / temperature  # (M, V): M real tokens of the chunk
                picked = logits.gather(-1, z[keep][:, None])[:, 0] - torch.logsumexp(logits, dim=-1)  # (M,)
                logp = torch.zeros(b, L, dtype=torch.float64, device=device)  # (b, L)
                logp[keep] = picked.double()
                total[idx.cpu(), j] = logp.sum(1).cpu()
                mean[idx.cpu(), j] = (logp.sum(1) / keep.sum(1)).cpu()
    return mean, total
