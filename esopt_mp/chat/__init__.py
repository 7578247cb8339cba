"""The words the agent loop, the environments and the endpoint share about a conversation: the chat format
(:mod:`.format`: ChatML rendering) and tool calls (:mod:`.toolcalls`: the one parser every reader uses, and the
cleaning of a reply's text). It imports nothing of esopt_mp, so every layer above may use it."""
