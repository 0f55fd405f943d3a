"""Tokenizers (byte-level for built-ins, tokenizer.json + chat template for model folders) and the text
stream: incremental detokenization and stop strings, streamed the same as whole."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from autoprofile.config import ServerConfig
from autoprofile.model_config import load_model_config
from autoprofile.serving.tokenizer import (BYTE_OFFSET, ByteTokenizer, ChatTemplateError, HFTokenizer,
                                           TextStream,
                                           load_tokenizer)

BYTES = ByteTokenizer(4096, eos_token_ids={2}, specials={1})


# ---------------------------------------------------------------- byte-level
def test_bytes_round_trip_and_every_id_decodes():
    text = "Hello, wörld! 你好 🙂"
    ids = BYTES.encode(text)
    assert ids == [b + BYTE_OFFSET for b in text.encode()] and BYTES.decode(ids) == text
    assert BYTES.decode([0, 1, 2]) == ""  # specials
    assert BYTES.decode([259, 260, 259 + 94, 259 + 95]) == " !~ "  # ids past the bytes: printable ASCII
    assert all(len(BYTES.decode([i])) == 1 for i in range(259, 4096))


def test_builtin_models_get_the_byte_tokenizer_with_the_configs_eos():
    tok = load_tokenizer(ServerConfig(model="llama-3.1-8b"))
    assert isinstance(tok, ByteTokenizer) and tok.eos_token_ids == {128001}
    assert tok.decode([128000, 128001]) == ""  # BOS and EOS are specials
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|user|>\nhi\n<|assistant|>\n"


def test_a_vocabulary_smaller_than_the_bytes_is_refused():
    with pytest.raises(ValueError, match="259"):
        ByteTokenizer(200)


# ---------------------------------------------------------------- tokenizer.json folders
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                 "{% if m['role'] == 'assistant' and loop.first %}"
                 "{{ raise_exception('start with a user') }}{% endif %}"
                 "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model folder with a BPE tokenizer.json trained here, a chat template and EOS ids."""
    d = tmp_path_factory.mktemp("model")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<|eot|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 50, trainer)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(d / "tokenizer.json"))
    cfg = dict(load_model_config("tiny").raw)
    cfg.update(vocab_size=tok.get_vocab_size(), eos_token_id=2)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE}))
    return d


def test_a_folder_with_tokenizer_json_uses_it_and_its_template(model_dir):
    tok = load_tokenizer(ServerConfig(model=str(model_dir)))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_ids == {2, 3}  # config.json + generation_config.json + tokenizer_config's eos_token
    ids = tok.encode("hello world")
    assert ids and tok.decode(ids) == "hello world"
    assert tok.decode(ids + [2]) == "hello world"  # specials are skipped
    text = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "hi"}])
    assert text == "<s>[system] be brief</s>[user] hi</s>[assistant] "
    with pytest.raises(ChatTemplateError, match="start with a user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_a_folder_without_a_chat_template_refuses_chat(model_dir, tmp_path):
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_text((model_dir / name).read_text())
    tok = load_tokenizer(ServerConfig(model=str(tmp_path)))
    assert isinstance(tok, HFTokenizer) and tok.eos_token_ids == {2}
    with pytest.raises(ChatTemplateError, match="/v1/completions"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_checkpoint_without_tokenizer_json_is_refused_unless_tokenizer_names_one(model_dir, tmp_path):
    """Byte-level text is only for random weights (--load_format dummy); a checkpoint needs its tokenizer."""
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"has no tokenizer\.json; give one with --tokenizer FOLDER"):
        load_tokenizer(ServerConfig(model=str(tmp_path)))
    named = load_tokenizer(ServerConfig(model=str(tmp_path), tokenizer=str(model_dir)))
    assert isinstance(named, HFTokenizer) and named.decode(named.encode("hello world")) == "hello world"
    assert named.chat is not None  # model_dir's tokenizer_config.json came with it
    assert isinstance(load_tokenizer(ServerConfig(model=str(tmp_path), load_format="dummy")), ByteTokenizer)


def test_multi_byte_characters_split_across_tokens_stream_whole(model_dir):
    tok = load_tokenizer(ServerConfig(model=str(model_dir)))
    text = "hello 你好 world 🙂"
    ids = tok.encode(text)
    stream = TextStream(tok)
    parts = [stream.push([i]) for i in ids] + [stream.finish()]
    assert "".join(parts) == text and not any("\ufffd" in p for p in parts)


# ---------------------------------------------------------------- stop strings
def stream_text(tok, ids: list[int], stop: list[str], step: int = 1) -> tuple[list[str], bool]:
    s = TextStream(tok, stop=stop)
    parts = []
    for i in range(0, len(ids), step):
        parts.append(s.push(ids[i:i + step]))
        if s.stopped:
            return parts, True
    parts.append(s.finish())
    return parts, s.stopped


def test_a_stop_string_split_across_tokens_ends_the_text_and_is_held_back():
    ids = BYTES.encode("The answer is 42. END of story")
    parts, stopped = stream_text(BYTES, ids, ["END"])
    assert stopped and "".join(parts) == "The answer is 42. "
    # while "E", "EN" could start the stop string, nothing after "42. " was sent
    s = TextStream(BYTES, stop=["END"])
    assert s.push(BYTES.encode("42. E")) == "42. " and s.push(BYTES.encode("N")) == ""
    assert s.push(BYTES.encode("X")) == "ENX"  # not a stop string after all: released


def test_the_stop_string_that_completes_first_wins():
    parts, stopped = stream_text(BYTES, BYTES.encode("abc STOP def HALT"), ["HALT", "STOP", "c S"])
    assert stopped and "".join(parts) == "ab"
    parts, stopped = stream_text(BYTES, BYTES.encode("xabc"), ["abc", "b"])
    assert stopped and "".join(parts) == "xa"  # "b" is complete before "abc" is


def test_held_text_is_released_when_the_request_ends_without_a_stop():
    parts, stopped = stream_text(BYTES, BYTES.encode("ends with ST"), ["STOP"])
    assert not stopped and "".join(parts) == "ends with ST" and parts[-1] == "ST"


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abcdé🙂 ", max_size=40),
       stops=st.lists(st.text(alphabet="abé🙂", min_size=1, max_size=4), max_size=3),
       step=st.integers(1, 5))
def test_streamed_text_is_the_whole_text_cut_at_the_first_completed_stop(text, stops, step):
    """Any chunking (step tokens at a time, multi-byte characters split) gives the same text."""
    parts, stopped = stream_text(BYTES, BYTES.encode(text), stops, step)
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    assert "".join(parts) == (text[:min(hits)[1]] if hits else text)
    assert stopped == bool(hits)


def test_a_tokenizer_json_vocabulary_reaches_xgrammar_as_text(model_dir):
    """Byte-level BPE pieces ("Ġ" for a space) are given to xgrammar decoded: a grammar's mask allows exactly
    the tokens whose text continues it; special tokens are never allowed, EOS only at the end."""
    xgrammar = pytest.importorskip("xgrammar")
    from autoprofile.serving.structured import Grammars, Spec
    tok = load_tokenizer(ServerConfig(model=str(model_dir)))
    vocab = tok.tok.get_vocab_size()
    m = Grammars(tok, vocab).new_matcher(Spec("regex", "hello world", "regex"))
    ids = tok.encode("hello world", add_special_tokens=False)
    assert any(tok.decode([i]).startswith(" ") for i in ids)  # a piece that holds the space
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    for i in ids:
        m.fill_next_token_bitmask(mask)
        allowed = {t for t in range(vocab) if mask[0, t // 32] >> (t % 32) & 1}
        assert i in allowed and not allowed & tok.special_ids
        assert all("hello world".startswith(tok.decode(ids[:ids.index(i)]) + tok.decode([t]))
                   for t in allowed)
        assert m.accept_token(i)
    m.fill_next_token_bitmask(mask)
    assert {t for t in range(vocab) if mask[0, t // 32] >> (t % 32) & 1} == {2, 3}  # the EOS ids
