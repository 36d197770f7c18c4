"""The update's forward pass, made cheap for multi-turn rows: each group's first prompt runs once, and micro-batches
gather rows of like length (docs/CPU.md). Same numbers as the plain pass over full rows (tests/test_sokoban.py).
Also the collapse diagnostics' cross-scoring pass: each prompt once, every reasoning packed after it (test_ragen2_maths.py)."""

from __future__ import annotations

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

    if body.is_gradient_checkpointing and body.training:  # transformers drops a cache under checkpointing: full rows
        L = mb["input_ids"].shape[1]
        attention = (torch.arange(L, device=mb["length"].device)[None] < mb["length"][:, None]).long()  # (b, L)
        return body(input_ids=mb["input_ids"], attention_mask=attention).last_hidden_state  # (b, L, H)
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

    if model.is_gradient_checkpointing and model.training:  # transformers drops a cache under checkpointing: full rows
        row, r = mb["row"], mb["r1"]
        out = model(
            input_ids=torch.cat([mb["prompt_ids"][row], mb["reply_in"]], dim=1),  # (b, p + r - 1)
            attention_mask=torch.cat([mb["prompt_attn"][row], torch.ones_like(mb["reply_in"])], dim=1),
            position_ids=torch.cat([mb["prompt_pos"][row], mb["reply_pos"]], dim=1),
            **({"logits_to_keep": r} if "logits_to_keep" in kw else kw),
        )
        return getattr(out, field)[:, -r:]  # (b, r, ...): the prompt's end, then reply tokens 0..r-2
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


def cross_logprobs(model, prompts: list[list[int]], thinks: list[list[int]], temperature: float = 1.0, max_tokens=1024):
    """RAGEN-2's cross-scoring matrices for the collapse diagnostics (collapse_metrics.py L455-558): log p(z_i | x_j)
    of every reasoning z_i (its sampled token ids) after every prompt x_j (token ids up to where z's tokens start),
    teacher-forced under logits / temperature, as the per-token mean and the sum over z_i's tokens: two (R, N)
    float64 tensors on the CPU, no gradient.

    RAGEN runs N passes of R full [x_j | z_i] rows. Here prompt j's row holds x_j once and then the reasonings one
    after another, each at its own positions (len(x_j) + t) and seeing only x_j and its own earlier tokens (a block
    mask): the same numbers as separate rows, for N * (prompt + all reasonings) tokens in one pass of N rows, with
    no copy of a prompt's keys and values. Reasonings go in passes of at most max_tokens tokens a row, which bounds
    the mask (N x row^2) and the wasted attention between reasonings; the output head sees only the scored tokens,
    1024 at a time, so the logits stay small under a 150k vocabulary.
    Empty reasonings or prompts are the caller's to leave out (an error here). Call it in eval mode (dropout off), as for the old log-probs.
    """
    if not prompts or not thinks or min(map(len, prompts)) == 0 or min(map(len, thinks)) == 0:
        raise ValueError("cross_logprobs needs non-empty prompts and reasonings (leave the empty ones out)")
    body, head = model.base_model, model.get_output_embeddings()
    device = next(model.parameters()).device
    N, P = len(prompts), max(map(len, prompts))
    x_len = torch.tensor([len(x) for x in prompts], device=device)[:, None]  # (N, 1)
    mean = torch.zeros(len(thinks), N, dtype=torch.float64)  # (R, N)
    total = torch.zeros_like(mean)  # (R, N)
    chunks, fed = [[]], 0  # consecutive reasonings whose fed tokens (all but the last) fit max_tokens
    for i, z in enumerate(thinks):
        if chunks[-1] and fed + len(z) - 1 > max_tokens:
            chunks, fed = chunks + [[]], 0
        chunks[-1].append(i)
        fed += len(z) - 1
    with torch.no_grad():
        for chunk in chunks:
            zs = [thinks[i] for i in chunk]
            fed_ids = [t for z in zs for t in z[:-1]]  # the reasonings' tokens a row feeds: all but each one's last
            seg = torch.tensor([-1] * P + [k for k, z in enumerate(zs) for _ in z[:-1]], device=device)  # (T,)
            offset = [t for z in zs for t in range(len(z) - 1)]  # each fed token's place in its reasoning
            ids = torch.zeros(N, len(seg), dtype=torch.long, device=device)  # (N, T): [x_j | padding | fed]
            for j, x in enumerate(prompts):
                ids[j, : len(x)] = torch.tensor(x, device=device)
            ids[:, P:] = torch.tensor(fed_ids, dtype=torch.long, device=device)
            t = torch.arange(len(seg), device=device)  # (T,)
            pos = torch.cat(
                [t[:P].expand(N, -1), x_len + torch.tensor(offset, dtype=torch.long, device=device)], dim=1
            )  # (N, T)
            q, k = t[:, None], t[None, :]  # (T, 1), (1, T)
            prompt_k = k[None] < x_len[:, :, None]  # (N, 1, T): the real prompt tokens of row j
            sees = torch.where(  # (N, T, T): a reasoning's token sees the prompt and its own reasoning so far,
                (q >= P)[None],  # a prompt token sees the prompt so far, a padding token itself only
                prompt_k | ((seg[:, None] == seg[None, :]) & (k <= q))[None],
                torch.where(q[None] < x_len[:, :, None], k <= q, k == q),
            )[:, None]  # (N, 1, T, T)
            if model.config._attn_implementation == "eager":  # eager adds the mask to the scores
                sees = torch.zeros(sees.shape, device=device).masked_fill(~sees, torch.finfo(torch.float32).min)
            h = body(input_ids=ids, attention_mask=sees, position_ids=pos).last_hidden_state  # (N, T, H)
            # a reasoning's first token is predicted at its prompt's end, each later one at the column before it
            ends = torch.cumsum(torch.tensor([len(z) - 1 for z in zs]), 0).tolist()  # each fed run's end, past P
            cols = [P + c for z, e in zip(zs, ends) for c in range(e - len(z) + 1, e)]  # (M - r,)
            where = torch.cat(
                [(x_len - 1).expand(N, len(zs)), torch.tensor(cols, dtype=torch.long, device=device).expand(N, -1)], 1
            )
            target = torch.tensor([z[0] for z in zs] + [t for z in zs for t in z[1:]], device=device)  # (M,)
            owner = torch.tensor(list(range(len(zs))) + [k for k, z in enumerate(zs) for _ in z[1:]], device=device)
            hs = h.gather(1, where[:, :, None].expand(-1, -1, h.shape[-1])).flatten(0, 1)  # (N * M, H)
            picks = target.repeat(N)[:, None]  # (N * M, 1)
            logp = torch.cat([  # (N * M,): the tokens' log-probs, 1024 tokens through the head at a time
                head(hs[a : a + 1024]).float().div(temperature).log_softmax(-1).gather(-1, picks[a : a + 1024])[:, 0]
                for a in range(0, len(picks), 1024)
            ]).double().view(N, -1)  # fmt: skip
            sums = torch.zeros(N, len(zs), dtype=torch.float64, device=device).index_add_(1, owner, logp)  # (N, r)
            lengths = torch.tensor([len(z) for z in zs], dtype=torch.float64, device=device)  # (r,)
            total[chunk], mean[chunk] = sums.T.cpu(), (sums / lengths).T.cpu()
    return mean, total
