"""Fill-in-the-middle prompts for `POST /infill`, as llama-server builds them (`format_prompt_infill`).

Why: editor completion plugins (llama.vscode, llama.vim) ask llama-server's `/infill` for the code
between the text before and after the cursor, with snippets of other files as context; coding
models of this project's families (Qwen3-Coder-Next is a `qwen3next` file) learnt Qwen's FIM
format, and a server that builds the prompt as llama-server does gives them what they were trained
on, and the plugins what they expect.

The repository-level layout (Qwen2.5-Coder, arXiv 2409.12186), token by token:

    [REPO]myproject\\n [SEP]name0\\n text0 ... [SEP]filename\\n [PRE]prefix prompt [SUF]suffix [MID]

The prefix keeps its last 3/4 of a batch of tokens, the suffix its first 1/4 (less the prompt and
2), the extra chunks what the context leaves after a batch and twice the answer's tokens
(`n_predict`, 0 when the request names none), kept from their end, and never more than leaves the
answer its room (llama-server would shift its context). Prefix, suffix and extra texts are
tokenized as plain text (special-token text in a file is not a token); the `prompt` is parsed for
special tokens, as in llama-server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

#: llama-server's default `--batch-size`, the unit its FIM budget is counted in
FIM_BATCH = 2048
#: each FIM role's spellings, Qwen's first (llama.cpp's vocabulary detects them so, by text)
_SPELLINGS = {
    "pre": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>"),
    "suf": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>"),
    "mid": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    rep: int | None
    sep: int | None

    @classmethod
    def of(cls, tokenizer: Any) -> FimTokens | None:
        """The vocabulary's FIM tokens; None without prefix, suffix and middle ones."""
        def find(role: str) -> int | None:
            return next((i for i in map(tokenizer.token_id, _SPELLINGS[role]) if i is not None), None)
        pre, suf, mid = find("pre"), find("suf"), find("mid")
        if pre is None or suf is None or mid is None:
            return None
        return cls(pre, suf, mid, find("rep"), find("sep"))


def infill_prompt(tokenizer: Any, fim: FimTokens, prefix: str, suffix: str, extra: Sequence[tuple[str, str]],
                  prompt: str, n_ctx: int, n_predict: int) -> list[int]:
    """The prompt's tokens (see the module docstring); `extra`: (file name, text) chunks."""
    def plain(text: str) -> list[int]:
        return tokenizer.encode(text, add_special=False, parse_special=False)

    n_batch = min(FIM_BATCH, n_ctx)
    extra_tokens: list[int] = []
    if fim.rep is not None:
        extra_tokens += [fim.rep] + plain("myproject\n")
    for name, text in extra:
        extra_tokens += ([fim.sep] + plain(name + "\n")) if fim.sep is not None else plain("\n\n--- snippet ---\n\n")
        extra_tokens += plain(text)
    if fim.sep is not None:
        extra_tokens += [fim.sep] + plain("filename\n")
    prompt_tokens = tokenizer.encode(prompt, add_special=False, parse_special=True)
    prefix_tokens, suffix_tokens = plain(prefix), plain(suffix)
    n_prefix = min(len(prefix_tokens), 3 * (n_batch // 4))
    n_suffix = min(len(suffix_tokens), max(0, n_batch // 4 - (2 + len(prompt_tokens))))
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    core = (bos + [fim.pre] + prefix_tokens[len(prefix_tokens) - n_prefix:] + prompt_tokens
            + [fim.suf] + suffix_tokens[:n_suffix] + [fim.mid])
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens),
                  max(0, n_ctx - max(1, n_predict) - len(core)))     # (and the answer keeps its room)
    return extra_tokens[len(extra_tokens) - n_extra:] + core          # (llama-server puts a BOS after them)
