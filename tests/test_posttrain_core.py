"""Post-training building blocks against hand-computed references."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.parallel import Strategy
from lmforge.posttrain.chat import chat_example, render_chatml
from lmforge.posttrain.core import (
    IGNORE,
    Example,
    collate,
    masked_mean,
    masked_sum_normalize,
    masked_whiten,
    prompt_response_example,
    sequence_logprobs,
    token_entropy,
    token_logprobs,
)
from lmforge.posttrain.tasks import CharTokenizer
from lmforge.train.objective import forward_backward
from lmforge.utils.errors import LmforgeError


def tiny_lm(vocab: int = 40, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, context_length=64, d_model=32, n_layers=2, n_heads=4)
    return TransformerLM(cfg)


def test_token_logprobs_match_float64_reference() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    labels[0, 0] = IGNORE
    for temp in (1.0, 0.7, 0.0):
        t = 1.0 if temp == 0 else temp
        ref = torch.log_softmax(logits.double() / t, -1).gather(-1, labels.clamp_min(0)[..., None])
        ref = ref.squeeze(-1).masked_fill(labels == IGNORE, 0.0)
        got = token_logprobs(logits, labels, temp)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=1e-6)


def test_token_entropy_reference() -> None:
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    ent = token_entropy(logits)
    torch.testing.assert_close(ent, torch.tensor([[math.log(4), 0.0]]), atol=1e-5, rtol=0)


def test_masked_reductions() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[True, True, False], [False, False, True]])
    assert float(masked_mean(x, m)) == pytest.approx((1 + 2 + 6) / 3)
    torch.testing.assert_close(masked_mean(x, m, dim=1), torch.tensor([1.5, 6.0]))
    assert float(masked_sum_normalize(x, m, 10.0)) == pytest.approx(0.9)
    torch.testing.assert_close(masked_sum_normalize(x, m, 2.0, dim=1), torch.tensor([1.5, 3.0]))
    w = masked_whiten(x, m)
    vals = torch.tensor([1.0, 2.0, 6.0])
    ref = (vals - vals.mean()) / vals.std()
    torch.testing.assert_close(w[m], ref, atol=1e-4, rtol=0)
    assert float(w[~m].abs().sum()) == 0.0


def test_prompt_response_masks_prompt_and_padding() -> None:
    ex = prompt_response_example([5, 6, 7], [8, 9], eos_id=1)
    assert ex.tokens == [5, 6, 7, 8, 9, 1]
    inputs, labels = ex.shifted()
    assert inputs == [5, 6, 7, 8, 9]
    assert labels == [IGNORE, IGNORE, 8, 9, 1]
    b = collate([ex, prompt_response_example([2], [3])], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [2, 0, 0, 0, 0]]
    assert b.labels.tolist() == [[IGNORE, IGNORE, 8, 9, 1], [3] + [IGNORE] * 4]
    with pytest.raises(LmforgeError):
        prompt_response_example([], [1])


def test_chatml_marks_assistant_turns_only() -> None:
    tok = CharTokenizer(alphabet="abcdefghijklmnopqrstuvwxyz<>|_\n ")
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "no"},
    ]
    ex = chat_example(tok, msgs)
    assert tok.decode(ex.tokens) == render_chatml(msgs, add_generation_prompt=False)
    trained = tok.decode([t for t, m in zip(ex.tokens, ex.trainable) if m])
    assert trained == "yo<|im_end|>\nno<|im_end|>\n"
    with pytest.raises(LmforgeError, match="role"):
        chat_example(tok, [{"role": "robot", "content": "x"}])
    with pytest.raises(LmforgeError, match="assistant"):
        chat_example(tok, [{"role": "user", "content": "x"}])


def test_chat_uses_the_tokenizers_own_template() -> None:
    class Tok:
        chat_template = "custom"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            s = "".join(f"[{m['role']}]{m['content']}." for m in messages)
            return s + ("[assistant]" if add_generation_prompt else "")

        def convert_tokens_to_ids(self, t):
            return 0

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    ex = chat_example(Tok(), msgs)
    assert "".join(chr(t) for t in ex.tokens) == "[user]q.[assistant]a."
    assert "".join(chr(t) for t, m in zip(ex.tokens, ex.trainable) if m) == "a."


@pytest.mark.parametrize("unit", ["token", "sequence"])
def test_accumulation_gradient_equals_full_batch(unit: str) -> None:
    """Σ loss_sum / Σ weight: the gradient of 3 uneven micro-batches equals the full batch's."""
    torch.manual_seed(1)
    exs = [
        prompt_response_example(
            torch.randint(2, 40, (3,)).tolist(), torch.randint(2, 40, (n,)).tolist()
        )
        for n in (1, 4, 2, 6, 3)
    ]

    def loss_fn(model, b):
        logp, _ = sequence_logprobs(model, b.input_ids, b.labels)
        if unit == "token":
            return -logp[b.mask].sum(), float(b.mask.sum())
        per_seq = -(logp * b.mask).sum(-1) / b.mask.sum(-1)
        return per_seq.sum(), float(len(per_seq))

    class Obj:  # the Trainer's objective contract; batch_weight when the weights are known
        def loss(self, model, b):
            loss_sum, w = loss_fn(model, b)
            return loss_sum, torch.tensor(w)

    class Known(Obj):
        def batch_weight(self, b):
            return float(b.mask.sum()) if unit == "token" else float(b.input_ids.shape[0])

    grads = []
    for split, known in (([5], False), ([1, 3, 1], False), ([1, 3, 1], True)):
        model = tiny_lm()
        chunks, i = [], 0
        for n in split:
            chunks.append(collate(exs[i : i + n]))
            i += n
        # weights up front: backward right after each forward (what SFT does)
        loss, _ = forward_backward(Strategy(model), chunks, Known() if known else Obj())
        grads.append((torch.cat([p.grad.flatten() for p in model.parameters()]), float(loss)))
    for g, loss in grads[1:]:
        torch.testing.assert_close(grads[0][0], g, atol=1e-6, rtol=1e-5)
        assert grads[0][1] == pytest.approx(loss, rel=1e-5)


@pytest.mark.requires("transformers")
def test_works_on_a_transformers_gpt2() -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=40,
        n_positions=32,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    b = collate([Example([3, 4, 5, 6], [False, False, True, True])])
    logp, ent = sequence_logprobs(model, b.input_ids, b.labels, with_entropy=True)
    ref = torch.log_softmax(model(b.input_ids).logits.double(), -1)
    assert float(logp[0, 2]) == pytest.approx(float(ref[0, 2, 6]), abs=1e-5)
    assert ent is not None and ent.shape == (1, 3)


# ---------------------------------------------------------------------------------------------
# Chat templates carried as strings (GGUF files, lmforge checkpoints) and the one GGUF path

# A SmolLM2-style template: a default system turn, trimmed blocks, a template error and EOS.
TEMPLATE = (
    "{% for message in messages %}\n"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nbe brief<|im_end|>\\n' }}{% endif %}\n"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role') }}{% endif %}\n"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% else %}"
    "{{ eos_token }}{% endif %}"
)


@pytest.mark.requires("transformers", "tokenizers")
def test_attached_template_renders_like_transformers() -> None:
    """A template string on a non-transformers tokenizer renders the text transformers renders."""
    from tokenizers import Tokenizer as HF
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from lmforge.posttrain.chat import attach_template, render_chat, template_of

    theirs = PreTrainedTokenizerFast(
        tokenizer_object=HF(WordLevel({"[eos]": 0, "[unk]": 1}, unk_token="[unk]")),
        eos_token="[eos]",
    )
    theirs.chat_template = TEMPLATE
    ours = attach_template(CharTokenizer(alphabet="abcdefghijklmnopqrstuvwxyz12<>|_\n "), TEMPLATE)
    assert template_of(ours) == TEMPLATE
    ours_eos = ours.decode([ours.eos_id])
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    for gen in (True, False):
        want = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        got = render_chat(ours, msgs, add_generation_prompt=gen)
        assert got == want.replace("[eos]", ours_eos)
    assert render_chat(ours, msgs).startswith("<|im_start|>system\nbe brief<|im_end|>\n")
    with pytest.raises(LmforgeError, match="chat template: bad role"):
        render_chat(ours, [{"role": "tool", "content": "x"}])
    # Pieces of a conversation follow the attached template; only assistant text trains.
    conv = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]
    ex = chat_example(ours, conv)
    assert ours.decode(ex.tokens) == render_chat(ours, conv, add_generation_prompt=False)
    trained = ours.decode([t for t, m in zip(ex.tokens, ex.trainable) if m])
    assert trained == "ba<|im_end|>\n" + ours_eos


def _word_tokenizer(folder) -> object:
    """A tiny `tokenizers` word-level tokenizer.json in ``folder``, loaded as an HFTokenizer."""
    import json

    from tokenizers import Tokenizer as HF
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from lmforge.hf.tokenizer import HFTokenizer

    words = ["<eos>", "<unk>", "hello", "world", "<|im_start|>", "<|im_end|>", "user", "x"]
    t = HF(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    t.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<eos>", "bos_token": "<|im_start|>"})
    )
    return HFTokenizer(folder)


def test_save_and_load_keep_the_hf_tokenizer_and_template(tmp_path) -> None:
    from lmforge.hf.tokenizer import HFTokenizer
    from lmforge.posttrain.chat import attach_template, template_of
    from lmforge.posttrain.models import eos_ids, load_model, save_model

    model = tiny_lm(vocab=8)
    tok = attach_template(_word_tokenizer(tmp_path / "tok"), TEMPLATE)
    out = save_model(model, tok, tmp_path / "saved")
    assert (out / "chat_template.jinja").read_text() == TEMPLATE
    model2, tok2 = load_model(out)
    assert isinstance(tok2, HFTokenizer) and template_of(tok2) == TEMPLATE
    assert tok2.encode("hello world x") == tok.encode("hello world x") == [2, 3, 7]
    assert eos_ids(tok2) == [0]
    from lmforge.posttrain.chat import render_chat

    bos_tpl = attach_template(_word_tokenizer(tmp_path / "tok3"), "{{ bos_token }}|{{ eos_token }}")
    assert render_chat(bos_tpl, [{"role": "user", "content": "x"}]) == "<|im_start|>|<eos>"
    ids = torch.tensor([[2, 3, 7, 1]])
    with torch.no_grad():
        torch.testing.assert_close(model2(ids), model(ids), rtol=0, atol=0)


SMOL = Path("/work/shared/models/SmolLM2-135M-Instruct.Q4_1.gguf")


def _old_transformers_gguf_path(p: Path):
    """The loader `load_model` used before `import_gguf`: transformers' GGUF tensor reader into a
    transformers Llama (kept here as the reference the new path must match)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(p), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    model.tie_weights()
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    return model.eval(), AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


@pytest.mark.slow
@pytest.mark.skipif(not SMOL.is_file(), reason="shared SmolLM2 GGUF not present")
def test_gguf_path_matches_the_old_transformers_path() -> None:
    """SmolLM2: same chat-templated ids and masks, per-token log-probs equal within fp32 tolerance
    (so figures measured with the transformers path, e.g. the DPO one, still stand)."""
    from lmforge.hf.tokenizer import HFTokenizer
    from lmforge.posttrain.core import is_lmforge_model
    from lmforge.posttrain.models import eos_ids, load_model

    new_model, new_tok = load_model(SMOL)
    assert is_lmforge_model(new_model) and isinstance(new_tok, HFTokenizer)
    old_model, old_tok = _old_transformers_gguf_path(SMOL)
    assert eos_ids(new_tok) == eos_ids(old_tok)
    convs = [
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."}],
        [
            {"role": "system", "content": "You answer in French."},
            {"role": "user", "content": "Say hello.\nTwice, please: naïve café 🎉"},
            {"role": "assistant", "content": "Bonjour ! Bonjour !"},
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": "De rien."},
        ],
        [
            {"role": "user", "content": "  spaces  and\ttabs"},
            {"role": "assistant", "content": "ok"},
        ],
    ]
    worst = 0.0
    for conv in convs:
        a, b = chat_example(new_tok, conv), chat_example(old_tok, conv)
        assert a.tokens == b.tokens and a.trainable == b.trainable
        batch = collate([a])
        with torch.no_grad():
            lp_new, _ = sequence_logprobs(new_model, batch.input_ids, batch.labels)
            lp_old, _ = sequence_logprobs(old_model, batch.input_ids, batch.labels)
        assert batch.mask.sum() > 0
        worst = max(worst, float((lp_new - lp_old)[batch.mask].abs().max()))
    assert worst < 1e-4, worst  # measured 1.0e-5 (2026-12-01)


@pytest.mark.requires("transformers", "tokenizers")
def test_transformers_folder_loads_as_a_transformers_model(tmp_path) -> None:
    """A transformers folder stays a transformers model with its own tokenizer and template."""
    import transformers
    from tokenizers import Tokenizer as HF
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from lmforge.posttrain.chat import render_chat
    from lmforge.posttrain.core import is_lmforge_model
    from lmforge.posttrain.models import eos_ids, load_model, save_model

    words = ["<eos>", "<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "hi", "yo"]
    t = HF(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")
    # (without the trailing EOS: a template whose prefixes do not extend one another is refused)
    tok.chat_template = TEMPLATE.replace("{{ eos_token }}", "")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=len(words), n_positions=64, n_embd=16, n_layer=1,
                                  n_head=2)  # fmt: skip
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    model, tok2 = load_model(tmp_path / "hf")
    assert not is_lmforge_model(model) and hasattr(tok2, "apply_chat_template")
    assert eos_ids(tok2) == [0]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert render_chat(tok2, msgs, False) == tok.apply_chat_template(msgs, tokenize=False)
    ex = chat_example(tok2, msgs)
    batch = collate([ex])
    logp, _ = sequence_logprobs(model, batch.input_ids, batch.labels)
    assert logp.shape == batch.labels.shape and bool(batch.mask.any())
    out = save_model(model, tok2, tmp_path / "saved")
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
    model3, _ = load_model(out)
    ids = torch.tensor([ex.tokens])
    with torch.no_grad():
        torch.testing.assert_close(model3(input_ids=ids).logits, model(input_ids=ids).logits)
