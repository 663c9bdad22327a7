"""The `tokenize`, `detokenize` and `tokenizer_info` utilities a worker answers for vLLM's /tokenize,
/detokenize and /tokenizer_info.

They run in the worker process, beside the engine's tokenizer, so the HTTP front stays free of
tokenizers and torch. Refused input (a chat template that raises, a model without one) comes back
as the result's `error`, for a 400; anything else raises and the utility call reports it.
"""

from __future__ import annotations

import msgspec

from disagg.engine.tokenizer import ChatTemplateError, Tokenizer
from disagg.types import InvalidRequest
from disagg.wire.engine_msgs import GenerateMsg, TokenizeMsg, TokenizeResultMsg


def tokenize(tokenizer: Tokenizer, arg: object) -> dict:
    """The token ids (and, if asked, their vocabulary strings) of a TokenizeMsg, as plain values."""
    msg = msgspec.convert(arg, TokenizeMsg)
    try:
        text = msg.prompt if msg.messages is None else chat_text(tokenizer, msg)
        if text is None:
            raise InvalidRequest("send a prompt or messages", "prompt")
        ids = tokenizer.encode(text, add_special_tokens=msg.add_special_tokens)
    except InvalidRequest as exc:
        return msgspec.to_builtins(TokenizeResultMsg(error=str(exc), error_param=exc.param))
    strs = [tokenizer.id_to_token(i) for i in ids] if msg.return_token_strs else None
    return msgspec.to_builtins(TokenizeResultMsg(tokens=ids, token_strs=strs))


def chat_text(tokenizer: Tokenizer, msg: TokenizeMsg | GenerateMsg, template_kwargs: dict | None = None) -> str:
    """The rendered chat (of /tokenize's chat form or of a chat completion: both carry `messages`,
    `add_generation_prompt` and `continue_final_message`). With `continue_final_message` the text
    ends right after the last message's content (no end-of-turn; its trailing whitespace kept where
    the template keeps it), as HF's apply_chat_template does, so the model continues that message."""
    if not msg.continue_final_message:
        return tokenizer.apply_chat_template(msg.messages, add_generation_prompt=msg.add_generation_prompt,
                                             template_kwargs=template_kwargs)
    text = tokenizer.apply_chat_template(msg.messages, add_generation_prompt=False, template_kwargs=template_kwargs)
    content = str(msg.messages[-1].get("content") or "")
    # As given first ("Sure, " keeps its space), then stripped, for templates that trim messages (HF's order).
    final = next((c for c in (content, content.strip()) if c and c in text), None)
    if final is None:
        raise ChatTemplateError("continue_final_message: the chat template does not render the final message's "
                                "content as given")
    return text[: text.rindex(final) + len(final)]


def detokenize(tokenizer: Tokenizer, token_ids: list[int], skip_special_tokens: bool = False) -> str:
    """The text of `token_ids`, special tokens kept unless skipped (vLLM's /detokenize keeps them;
    a beam search's answer skips them as its request says)."""
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def tokenizer_info(tokenizer: Tokenizer, model_name: str) -> dict:
    """vLLM's /tokenizer_info body: the tokenizer's class and settings (its special tokens, the
    vocabulary's size, the chat template when the model has one)."""
    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.id_to_token(token_id)
    info = {"name_or_path": model_name, "tokenizer_class": "PreTrainedTokenizerFast", "vocab_size": tokenizer.vocab_size,
            "bos_token": text(tokenizer.bos_token_id),
            "eos_token": text(tokenizer.eos_token_ids[0]) if tokenizer.eos_token_ids else None,
            "add_bos_token": tokenizer.bos_token_id is not None and tokenizer.bos_token_id in tokenizer.encode(""),
            "added_special_tokens": sorted(tokenizer.id_to_token(i) for i in tokenizer.special_token_ids)}
    if tokenizer.chat_template is not None:
        info["chat_template"] = tokenizer.chat_template
    return info
