"""Soft labels: the target's distribution kept while collecting (train/data.py
top_of, in every eagle3 window) and the loss against it (train/eagle_fit.py
Shard.soft_targets, Sequences.soft)."""

from __future__ import annotations

import torch

from conftest import tiny
from specdecode.train import data, eagle_fit, passages
from specdecode.train.fit import target_to_draft
from test_eagle import eagle_for

LAYERS = (0, 1)
DRAFT_IDS = torch.arange(19, -1, -1)  # target id i is draft id 19 - i

def _fresh_logp(target, ids: list[int], rows: int) -> torch.Tensor:  # -> [rows, V]
    """log-softmax of a fresh teacher-forced pass's last `rows` logits."""
    target.rollback(0)
    out = target.forward(torch.tensor(ids), last_n=rows)
    return torch.log_softmax(out.logits.float(), -1)


def _check_top(target, shard: dict[str, torch.Tensor], prompt: list[int]) -> None:
    """Rows before the prompt's last hold nothing (-1 / 0); from it on, row p's ids
    are the target's SOFT_K most likely after x_{s+p} and their log-probabilities."""
    a, s = int(shard["answer_start"][0]), int(shard["start"][0])
    ids, logp = shard["top_ids"], shard["top_logp"]
    assert ids.shape == logp.shape == (len(shard["aux"]), data.SOFT_K)
    assert (ids[: a - 1] == -1).all() and (logp[: a - 1] == 0).all()
    greedy = shard.get("greedy", shard["ids"][1:])  # row p's greedy token
    assert torch.equal(ids[a - 1:, 0].long(), greedy[a - 1:])
    text = prompt + shard["ids"][a:].tolist()
    assert len(text) - s == len(shard["ids"])
    fresh = _fresh_logp(target, text[:-1], len(ids) - a + 1)  # rows a-1 .. T-1
    want = fresh.topk(data.SOFT_K, -1)
    assert torch.equal(ids[a - 1:].long(), want.indices)
    assert torch.allclose(logp[a - 1:].float(), want.values.half().float(), atol=1e-2)


def test_collected_windows_hold_the_targets_distribution(tmp_path):
    """One at a time, batched, sampled answers and teacher-forced passages: each
    window's top_ids / top_logp are a fresh pass's top SOFT_K at every scored row."""
    from safetensors.torch import load_file
    target = tiny(9)
    prompts = ["3 1 4 1 5 9", "5 3 5 8 9 7 9 3", "2 3 8 4 6 2 6 4 3"]
    encode = lambda p: [int(x) for x in p.split()]  # noqa: E731
    for p in prompts:
        _check_top(target, data.answer_with_context(target, encode(p), 7, (4,), LAYERS, 5),
                   encode(p))
    plan = data.BatchPlan(3, LAYERS, 5, samples=2, temperature=1.0)
    paths = data.collect_batched(target, encode, prompts, tmp_path, plan, max_new_tokens=7,
                                 stop_ids=(4,), progress=False)
    assert len(paths) == 6
    for path in paths:
        _check_top(target, load_file(str(path)), encode(prompts[int(path.name[:6])]))
    prompt, answer = [5, 9, 2, 6, 5, 3], [7, 7, 1, 40, 2, 9, 11]
    _check_top(target, passages.teacher_forced(target, prompt, answer, LAYERS, 3), prompt)


def _window() -> tuple[eagle_fit.Shard, torch.Tensor]:
    """A 7-row window whose answer starts at index 3, row r's top ids r*3 .. r*3+3
    (ids 20+ outside the draft vocabulary of ids 0..19) with decreasing log-probs,
    and the greedy answer they make (x_{r+1} = row r's first id)."""
    t, k = 7, 4
    top_ids = (torch.arange(t)[:, None] * 3 + torch.arange(k)[None]).int()
    top_logp = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))[None].repeat(t, 1).half()
    top_ids[:2], top_logp[:2] = -1, 0  # rows before the prompt's last (answer_start - 1)
    ids = torch.cat((torch.tensor([1, 2, 3]), top_ids[2:, 0].long()))  # [T + 1]
    shard = eagle_fit.Shard(torch.randn(t, 8), ids, 3, 0, top_ids=top_ids, top_logp=top_logp)
    return shard, target_to_draft(DRAFT_IDS, 30)


def test_soft_targets_are_the_next_rows_distribution_inside_the_draft_vocabulary():
    """Entry p's soft label is row p + 1's distribution, in draft ids, renormalised
    over the ids the draft vocabulary holds; unscored entries weigh nothing."""
    shard, t2d = _window()
    for depth in (0, 1):
        draft, w = shard.soft_targets(t2d, depth)
        labels = shard.labels(t2d, depth)
        for p in range(7):
            if labels[p] < 0:
                assert (w[p] == 0).all(), (depth, p)
                continue
            row = shard.top_ids[p + 1].long()
            inside = row < 20
            assert draft[p][inside].tolist() == (19 - row[inside]).tolist()
            assert int(draft[p][w[p].argmax()]) == int(labels[p])
            probs = torch.tensor([0.5, 0.25, 0.15, 0.1]) * inside
            assert torch.allclose(w[p], probs / probs.sum(), atol=1e-3), (depth, p)
    assert (shard.labels(t2d, 0) >= 0).tolist() == [False] + [True] * 5 + [False]
    w = shard.soft_targets(t2d, 0)[1]
    assert (w[5, 2:] == 0).all() and w[5, :2].sum() > 0.99  # row 6: ids 20, 21 outside


def test_soft_loss_is_the_hard_loss_for_a_one_hot_target_and_differs_otherwise():
    """With all the target's mass on its greedy token the soft loss equals the greedy
    cross-entropy (and its gradient); with the mass spread it does not; windows
    without a kept distribution use their greedy labels either way."""
    target = tiny(7)
    head = eagle_for(target, 40)
    t2d = target_to_draft(head.draft_ids, head.config.target_vocab_size)
    torch.manual_seed(3)
    width = head.fc.in_features
    shard = eagle_fit.Shard(torch.randn(16, width), torch.randint(0, 40, (17,)), 9, 4)
    spread = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    others = torch.randint(40, 50, (16, 3))  # outside the 40-id draft vocabulary
    shard.top_ids = torch.cat((shard.ids[1:17, None], others), 1).int()
    shard.top_logp = torch.tensor([0.0, -60, -60, -60]).repeat(16, 1).half()
    hard = eagle_fit.Sequences([shard], 4).loss(head, t2d)
    hard.backward()
    grad = head.fc.weight.grad.clone()
    head.zero_grad()
    soft = eagle_fit.Sequences([shard], 4, soft=True).loss(head, t2d)
    soft.backward()
    assert torch.allclose(soft, hard, atol=1e-5)
    assert torch.allclose(head.fc.weight.grad, grad, atol=1e-6)
    inside = torch.randint(0, 40, (16, 3))
    shard.top_ids = torch.cat((shard.ids[1:17, None], inside), 1).int()
    shard.top_logp = spread.repeat(16, 1).half()
    with torch.no_grad():
        spread_loss = eagle_fit.Sequences([shard], 4, soft=True).loss(head, t2d)
        assert abs(float(spread_loss) - float(hard)) > 0.1
        shard.top_ids = None
        assert torch.allclose(eagle_fit.Sequences([shard], 4, soft=True).loss(head, t2d), hard)
