"""Token in, token out: sampled ids are recorded and spliced into later prompts unchanged.

The tiny tokenizer has "a" -> 67, "b" -> 68 and a merged "ab" -> 439, so sampling the two tokens
[67, 68] decodes to "ab", which re-encodes as [439]: decode -> encode is not the identity.
"""

from __future__ import annotations

import pytest

from verl_mas import GenerateRequest, Sample, Workflow, assistant, render_prompt, system, user
from verl_mas.testing import WorkflowCheckError, arun_workflow, check_workflow, default_tokenizer

A, B, AB = 67, 68, 439


def _contains(haystack: list[int], needle: list[int]) -> bool:
    return any(haystack[i : i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def test_the_tokenizer_really_drifts(tok):
    # Preconditions of every test below; if the tokenizer changes, the ids must be re-derived.
    assert tok.encode("a", add_special_tokens=False) == [A]
    assert tok.encode("b", add_special_tokens=False) == [B]
    assert tok.decode([A, B]) == "ab"
    assert tok.encode("ab", add_special_tokens=False) == [AB]
    assert tok.eos_token_id == 2 and tok.convert_ids_to_tokens(2) == "<|im_end|>"


def test_plain_chat_matches_apply_chat_template(tok):
    chat = [system("You plan."), user("Go right or left?"), assistant("right"), user("Again?")]
    expected = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert render_prompt(tok, chat) == expected
    # The piece cache gives the same ids on a second render.
    assert render_prompt(tok, chat) == expected


def test_sampled_ids_are_spliced_in_and_the_eos_is_not_doubled(tok):
    head = [system("sys"), user("say it")]
    sampled = [A, B, tok.eos_token_id]  # as a server returns them: the EOS included
    chat = [*head, assistant("ab", token_ids=sampled), user("next")]
    ids = render_prompt(tok, chat)
    # Expected by hand: the generation prompt of `head` ends with "<|im_start|>assistant\n", exactly where the
    # template writes the assistant content; then the sampled ids (their EOS closes the message, the template's
    # own "<|im_end|>" is dropped), then the rest of the template: "\n<|im_start|>user\nnext<|im_end|>\n" + header.
    expected = (
        tok.apply_chat_template(head, tokenize=True, add_generation_prompt=True, return_dict=False)
        + sampled
        + tok.encode("\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    )
    assert ids == expected
    assert _contains(ids, [A, B, 2]) and AB not in ids
    assert ids.count(tok.eos_token_id) == 4  # one per message, no doubled <|im_end|>

    # A truncated response (no EOS sampled) keeps the template's closing token.
    cut = render_prompt(tok, [*head, assistant("ab", token_ids=[A, B]), user("next")])
    assert cut == expected


def test_re_encoding_the_text_is_what_the_splice_avoids(tok):
    # Negative control: the same chat with the text only (as `user(best.text)`-style code does) drifts.
    ids = render_prompt(tok, [system("sys"), user("say it"), assistant("ab"), user("next")])
    assert AB in ids and not _contains(ids, [A, B])


class _TokenClient:
    """Samples [a, b, EOS] for every candidate: two tokens whose text re-encodes as one."""

    tokenizer = None

    def __init__(self):
        self.requests: list[GenerateRequest] = []

    async def generate(self, request):
        self.requests.append(request)
        return [Sample(token_ids=[A, B, 2], logprobs=[-0.5, -0.25, -0.125], stop_reason="completed")] * request.n


class _Continue(Workflow):
    """Continues its own chat with the committed candidate, as the docs say."""

    roles = ("talker",)
    reencode = False

    async def run(self, task):
        chat = [system("You talk."), user("Say something.")]
        for _ in self.turns():
            group = await self.generate("talker", chat)
            for c in group:
                c.reward = float(len(c.text))
            best = group.best()
            chat += [assistant(best.text) if self.reencode else best.as_message(), user("More.")]


class _Reencode(_Continue):
    reencode = True


async def test_candidates_keep_sampled_ids_and_logprobs_and_continue_with_them():
    client = _TokenClient()
    episode = await arun_workflow(_Continue, {}, client, branching=2, max_turns=2)
    first = episode.groups[0].committed
    assert first.response_ids == [A, B, 2] and first.text == "ab"
    assert first.logprobs == [-0.5, -0.25, -0.125]
    second_prompt = client.requests[1].prompt_ids
    assert _contains(second_prompt, [A, B, 2]) and AB not in second_prompt


async def test_decode_reencode_workflow_fails_the_token_test():
    client = _TokenClient()
    await arun_workflow(_Reencode, {}, client, branching=2, max_turns=2)
    second_prompt = client.requests[1].prompt_ids
    assert not _contains(second_prompt, [A, B, 2]) and AB in second_prompt  # the drift the splice prevents


def test_check_workflow_flags_reencoded_history():
    check_workflow(_Continue, {})
    with pytest.raises(WorkflowCheckError, match="decoded and re-encoded"):
        check_workflow(_Reencode, {})


class _DropsAssistant:
    """A tokenizer whose template drops assistant history (as some reasoning templates do)."""

    def __init__(self, tok):
        self.tok = tok

    def apply_chat_template(self, messages, **kwargs):
        return self.tok.apply_chat_template([m for m in messages if m["role"] != "assistant"], **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_template_that_drops_spliced_content_is_an_error(tok):
    with pytest.raises(ValueError, match="exactly once, in order"):
        render_prompt(_DropsAssistant(tok), [user("x"), assistant("ab", token_ids=[A, B])])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "list of message dicts"),
        ([], "empty"),
        ([{"role": "user"}], "content"),
        ([{"role": "assistant", "content": "x", "token_ids": ["a"]}], "token_ids"),
    ],
)
def test_malformed_messages_are_rejected_with_a_fix(tok, messages, match):
    with pytest.raises(ValueError, match=match) as info:
        render_prompt(tok, messages)
    assert "verl_mas.chat.system/user/assistant" in str(info.value)
