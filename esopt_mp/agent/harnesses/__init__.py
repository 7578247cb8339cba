"""The field's agent frameworks as harnesses of ``objective=harness`` (each module one framework, imported only when
``objective.callable`` names it: the framework is an optional install)."""
