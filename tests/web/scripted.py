"""A scripted stand-in for the generation engine: each conversation replies from its own list, in order."""
import dataclasses


class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 1000 for c in text[:64]]

    def convert_tokens_to_ids(self, token):
        return 1


@dataclasses.dataclass
class _Conv:
    cid: int
    ids: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Gen:
    token_ids: list
    text: str
    finish: str = "eos"
    prefill_tokens: int = 0
    seconds: float = 0.0


class ScriptedEngine:
    def __init__(self, replies: list[list[str]]):
        self.replies, self.tokenizer = [list(r) for r in replies], _Tok()

    def new_conversation(self, cid, seed):
        return _Conv(cid)

    def generate(self, convs, new_ids, params, max_new=None):
        """Each reply is 2 tokens; ``max_new`` (a token budget's per-row caps) must leave room for them."""
        assert max_new is None or min(max_new) >= 2, max_new
        out = []
        for conv, ids in zip(convs, new_ids):
            conv.ids.extend(ids)
            text = self.replies[conv.cid].pop(0) if self.replies[conv.cid] else "no more script"
            out.append(_Gen([2, 1], text))
            conv.ids.extend([2, 1])
        return out
