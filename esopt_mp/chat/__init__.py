"""The words the agent loop, the environments and the endpoint share about a conversation: the chat format
(:mod:`.format`: ChatML rendering, or a model's own template, and a reply as valid text) and tool calls
(:mod:`.toolcalls`: the one parser every reader uses). It imports nothing of esopt_mp, so every layer above may
use it."""
