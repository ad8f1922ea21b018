"""Teacher-forced logits of our paged model vs transformers on the same fp32 weights."""

from __future__ import annotations

import torch

from tests.workers.conftest import SeqChunk, run_batch

PAGE = 16
TOL = 1e-3

CHATS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Write a haiku about the sea.", "Waves fold,\nsalt wind and gulls,\nthe tide keeps time."),
    ("2+2=?", "4"),
    ("Translate 'good morning' to German.", "Guten Morgen."),
    ("Explain recursion briefly.", "A function calling itself on a smaller problem."),
    ("List three primes.", "2, 3 and 5."),
    ("Qu'est-ce que la photosynthèse ?", "Les plantes font du sucre grâce à la lumière."),
    ("用一句话介绍长城。", "长城是中国古代修建的防御工事。"),
    ("Give me an emoji for happiness", "😀 or 🎉"),
    ("def add(a, b):", "```python\ndef add(a, b):\n    return a + b\n```"),
    ("Tell me a joke.", "The scarecrow won an award: outstanding in his field."),
    ("", "It looks like your message is empty."),
    ("What's 17 * 23?", "17 * 23 = 391."),
    ("Name a color.", "Blue."),
    ("Summarize: The quick brown fox jumps over the lazy dog.", "A fox jumps over a dog."),
    ("Is the earth flat?", "No, the Earth is an oblate spheroid."),
    ("Write JSON with a name field.", '{"name": "SmolLM"}'),
    ("Count to ten.", "1 2 3 4 5 6 7 8 9 10"),
    ("How do I boil an egg?", "Boil it for 9 minutes, then cool it in cold water."),
    ("Say hi in Japanese.", "こんにちは"),
]  # fmt: skip


def _sequences(tokenizer) -> list[list[int]]:
    seqs = []
    for k, (question, answer) in enumerate(CHATS):
        messages = [{"role": "user", "content": question}]
        if k % 4 == 1:
            messages.insert(0, {"role": "system", "content": "You answer briefly."})
        if k % 5 == 2:  # multi-turn
            messages = [
                {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                *messages,
            ]
        prompt = tokenizer.apply_chat_template(messages)
        seqs.append(prompt + tokenizer.encode(answer) + [tokenizer.eos_token_id])
    return seqs


def _hf_logits(hf_model, seqs: list[list[int]]) -> list[torch.Tensor]:
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.inference_mode():
        logits = hf_model(input_ids=ids, attention_mask=mask).logits
    return [logits[i, : len(s)] for i, s in enumerate(seqs)]


def test_teacher_forced_logits_match_transformers(loaded_model, hf_model):
    seqs = _sequences(loaded_model.tokenizer)
    assert len(seqs) == 20 and sum(len(s) for s in seqs) > 800
    model = loaded_model.model
    blocks_per_seq = max(-(-len(s) // PAGE) for s in seqs)
    pool = model.allocate_kv_pool(len(seqs) * blocks_per_seq, PAGE)
    chunks = [
        SeqChunk(list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), 0, s)
        for i, s in enumerate(seqs)
    ]
    ours = run_batch(model, pool, chunks, PAGE)  # all 20 sequences in one forward
    refs = _hf_logits(hf_model, seqs)
    worst = 0.0
    for i, s in enumerate(seqs):
        got = torch.stack([ours[(i, p)] for p in range(len(s))])
        assert got.dtype == torch.float32 and got.shape == (len(s), 49152)
        worst = max(worst, (got - refs[i]).abs().max().item())
    assert worst < TOL, worst


def test_greedy_continuation_matches_transformers(loaded_model, hf_model):
    tok = loaded_model.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    with torch.inference_mode():
        ref = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, attention_mask=None
        )[0, len(prompt) :].tolist()
    model = loaded_model.model
    pool = model.allocate_kv_pool(4, PAGE)
    blocks = [0, 1, 2, 3]
    logits = run_batch(model, pool, [SeqChunk(blocks, 0, prompt, all_logits=False)], PAGE)
    out = [int(logits[(0, len(prompt) - 1)].argmax())]
    while len(out) < len(ref):
        pos = len(prompt) + len(out) - 1
        step = run_batch(model, pool, [SeqChunk(blocks, pos, [out[-1]])], PAGE)
        out.append(int(step[(0, pos)].argmax()))
    assert out == ref
    assert tok.decode(out).startswith("The capital of France is Paris.")
