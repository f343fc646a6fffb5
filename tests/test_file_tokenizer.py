"""FileTokenizer (tokenizers + jinja2, no transformers) against transformers' fast tokenizer on the
same files: equal ids, text, vocabulary and chat renderings on the project's prompt sets."""
import copy

import pytest

from snapcompile.artifact.files import artifact_tokenizer
from snapcompile.artifact.manifest import read_manifest
from snapcompile.errors import SnapcompileError
from snapcompile.evaluation.conversations import KINDS, make_conversation
from snapcompile.evaluation.tasks import fidelity_text, make_cases
from snapcompile.models.file_tokenizer import FileTokenizer
from snapcompile.models.tokenizer import load_tokenizer
from snapcompile.passkeys import demo_prompts, passkey_prompt
from snapcompile.prompts import encode_messages, set_chat_template

FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! <|im_end|> not a token here"},
     {"role": "user", "content": "héllo 日本 🙂"}],
    [{"role": "user", "content": "call it"},
     {"role": "assistant", "content": "<tool_call>{\"name\": \"f\"}</tool_call>"},
     {"role": "tool", "content": "{\"result\": 3}"}, {"role": "user", "content": ""}],
]


def _pair(folder, files):
    return load_tokenizer(folder, files=files), FileTokenizer.from_folder(folder, files)


@pytest.fixture(scope="module")
def smol_pair():
    from snapcompile.models.loader import _smollm2_folder
    return _pair(_smollm2_folder(), FILES)


def _texts(tokenizer) -> list[str]:
    text = fidelity_text()
    conversations = [make_conversation(tokenizer, kind, "tune", 0, 2500, 0, True) for kind in KINDS]
    ruler = [case.prompt for task in ("passkey", "multikey") for case in make_cases(task, tokenizer, [1500], [0.5],
                                                                                   1, 0, False)]
    return (demo_prompts() + [passkey_prompt(12345, 500)] + ruler + [text[i:i + 2000] for i in range(0, 130000, 9000)]
            + [q for c in conversations for q in (c.first_message(), *c.questions)]
            + ["", " ", "  leading spaces", "\n\n\ttabs\r\n", "<|im_start|>user\nhi<|im_end|>", "a" * 3000,
               "\u2063 zero width \u200b and \ufeff", "emoji 🙂👍🏽 and 中文 and العربية"])


@pytest.mark.parametrize("which", ["smollm2", "tiny byte-level"])
def test_ids_text_vocab_and_chats_equal_transformers(which, smol_pair, tiny_dense_dir):
    hf, mine = smol_pair if which == "smollm2" else _pair(tiny_dense_dir, read_manifest(tiny_dense_dir).support_files())
    assert mine.get_vocab() == hf.get_vocab() and len(mine) == len(hf)
    assert (mine.eos_token, mine.eos_token_id, mine.bos_token) == (hf.eos_token, hf.eos_token_id, hf.bos_token)
    assert mine.chat_template == hf.chat_template
    for text in _texts(hf):
        ids = mine.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text[:60]
        for skip in (False, True):
            assert mine.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    for chat in CHATS:
        for generation in (False, True):
            assert mine.apply_chat_template(chat, add_generation_prompt=generation) == \
                hf.apply_chat_template(chat, add_generation_prompt=generation, tokenize=False)
        assert encode_messages(mine, chat) == encode_messages(hf, chat)


def test_artifacts_are_read_without_transformers_and_copies_are_independent(tiny_dense_dir):
    tokenizer = artifact_tokenizer(tiny_dense_dir, read_manifest(tiny_dense_dir))
    assert isinstance(tokenizer, FileTokenizer)
    twin = copy.deepcopy(tokenizer)
    assert twin.core is not tokenizer.core and twin.encode("abc") == tokenizer.encode("abc")


def test_a_template_failure_or_a_bad_file_is_one_clear_error(tmp_path, tiny_dense_dir):
    import jinja2
    for name in FILES[:2]:
        (tmp_path / name).write_bytes((tiny_dense_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    tokenizer = FileTokenizer.from_folder(tmp_path, FILES)
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        tokenizer.apply_chat_template(CHATS[0])
    with pytest.raises(SnapcompileError, match="the chat template failed"):
        encode_messages(tokenizer, CHATS[0])
    (tmp_path / "chat_template.jinja").write_text("{% set ns = namespace(_x=1) %}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        FileTokenizer.from_folder(tmp_path, FILES).apply_chat_template(CHATS[0])
    assert FileTokenizer.from_folder(tmp_path, FILES[:2]).chat_template is None, "an unlisted template is not read"
    (tmp_path / "tokenizer.json").write_text("{")
    with pytest.raises(SnapcompileError, match="cannot load the tokenizer"):
        FileTokenizer.from_folder(tmp_path, FILES)


@pytest.mark.parametrize("which", ["smollm2", "tiny byte-level"])
def test_template_options_render_as_transformers_renders_them(which, smol_pair, tiny_dense_dir):
    """continue_final_message (the text cut after the final message) and extra template variables,
    through render_messages on our tokenizer and on transformers' (whose own options they are)."""
    from snapcompile.prompts import TemplateOptions, render_messages
    hf, mine = smol_pair if which == "smollm2" else _pair(tiny_dense_dir, read_manifest(tiny_dense_dir).support_files())
    hf, mine = copy.deepcopy(hf), copy.deepcopy(mine)            # the fixture's stay as they are
    template = "{{ greeting }}|" + mine.chat_template
    for tokenizer in (hf, mine):
        set_chat_template(tokenizer, template)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The sky is  "}]
    continuing = TemplateOptions(add_generation_prompt=False, continue_final_message=True,
                                 variables=(("greeting", "hello"),))
    expected = hf.apply_chat_template(chat, continue_final_message=True, tokenize=False, greeting="hello")
    assert render_messages(mine, chat, options=continuing) == render_messages(hf, chat, options=continuing) == expected
    assert expected.startswith("hello|") and expected.endswith("The sky is  ")
    with pytest.raises(SnapcompileError, match="cannot both be true"):
        TemplateOptions(continue_final_message=True)
