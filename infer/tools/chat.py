"""``specheads chat``: an interactive terminal chat on any verifier + drafter.

Replies stream as they are accepted; after each reply a status line shows its tau and speed.
Ctrl-C stops the current reply (what was generated stays in the conversation); Ctrl-D or
``/exit`` leaves; ``/reset`` starts a new conversation.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from ..core.engine import Engine
from ..core.errors import UserError
from ..core.params import SamplingParams
from ..core.text import StreamDecoder, eos_ids

HELP = "commands: /reset (new conversation), /exit (or Ctrl-D); Ctrl-C stops a reply"


@dataclass
class ChatSession:
    """The conversation so far and how each reply is generated."""

    model: object
    tokenizer: object
    drafter: object
    system: str | None = None
    gen_kwargs: dict = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)
    verifier: object = None  # a Verifier of ``model`` to generate with (None: one with the auto kernel)
    budget: str = "fixed"  # the engine's (see Engine): it lives as long as the session, and learns
    compile: str = "off"  # the engine's verify step (--compile)
    engine: Engine | None = None

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def encode(self) -> torch.Tensor:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise UserError("this verifier's tokenizer has no chat template: chat needs one")
        ids = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return torch.tensor(ids["input_ids"], dtype=torch.long)

    def check_turn(self, user_text: str) -> None:
        """A :class:`UserError` when ``user_text`` cannot be sent: not valid text, or the history
        with it plus ``max_new_tokens`` beyond the verifier's context (``/reset`` starts afresh)."""
        from ..core.text import check_text
        from ..core.verifier import check_fits

        check_text(user_text, "this message")
        self.messages.append({"role": "user", "content": user_text})
        try:
            n = self.encode().numel()
        finally:
            self.messages.pop()
        config = getattr(self.verifier, "config", None) or self.model.config
        try:
            check_fits(config, n + self.gen_kwargs.get("max_new_tokens", 128),
                       "the conversation with this message plus max_new_tokens")
        except UserError as e:
            raise UserError(f"{e}, or /reset to start a new conversation") from None

    def reply(self, user_text: str, out=None) -> str:
        """Generate the assistant's answer to ``user_text``, streaming it to ``out``; returns the
        status line. A KeyboardInterrupt stops the reply early and keeps what was said."""
        out = out or sys.stdout
        self.messages.append({"role": "user", "content": user_text})
        tokens: list[int] = []
        pieces = StreamDecoder(self.tokenizer)
        stats = None
        stopped = False
        try:  # checked before any work (e.g. history plus max_new_tokens beyond the context)
            if self.engine is None:
                self.engine = Engine(self.verifier or self.model, self.drafter, budget=self.budget, compile=self.compile)
            self.engine.add(self.encode(), SamplingParams(**self.gen_kwargs), tokenizer=self.tokenizer,
                            eos_token_id=eos_ids(self.model, self.tokenizer))
        except UserError:
            self.messages.pop()  # the turn is refused; the conversation so far stays
            raise
        chunks = self.engine.run()
        try:
            for chunk in chunks:
                tokens.extend(chunk.token_ids)
                stats = chunk.stats
                out.write(pieces.push(chunk.token_ids))
                out.flush()
        except KeyboardInterrupt:
            stopped = True
            chunks.close()
            self.engine.reset()  # the reply's row leaves
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        out.write(pieces.flush() + ("  [stopped]" if stopped else "") + "\n")
        self.messages.append({"role": "assistant", "content": text})
        if stats is None:
            return "[no tokens]"
        return (f"[tau {stats.mean_accepted:.2f} | {stats.tokens_per_s:.1f} tokens/s | {stats.new_tokens} tokens | "
                f"{stats.verify_steps} verify steps]")


def run_chat(session: ChatSession, inp=None, out=None, err=None) -> int:
    """The read-eval loop (standard streams by default). Returns the exit status."""
    inp, out, err = inp or sys.stdin, out or sys.stdout, err or sys.stderr
    if getattr(session.tokenizer, "chat_template", None) is None:  # every turn would be refused: stop now
        raise UserError("this verifier's tokenizer has no chat template: chat needs one")
    session.reset()
    print(HELP, file=err)
    interactive = inp.isatty()
    while True:
        try:
            if interactive:
                line = input("you> ")
            else:
                line = inp.readline()
                if not line:
                    break
                line = line.rstrip("\n")
        except EOFError:
            break
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, not an exit
            print(file=out)
            continue
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit"):
            break
        if cmd == "/reset":
            session.reset()
            print("[new conversation]", file=err)
            continue
        try:
            session.check_turn(cmd)
        except UserError as e:  # this turn is refused; the session goes on
            print(f"[not sent: {e}]", file=err)
            continue
        out.write("assistant> ")
        try:
            status = session.reply(cmd, out)
        except UserError as e:
            status = f"[not sent: {e}]"
        print(status, file=err)
    return 0
