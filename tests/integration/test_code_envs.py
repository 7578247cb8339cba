"""Code environments (one sandbox process per tool call) may run a batch's calls at once."""


def test_code_envs_run_their_tool_calls_concurrently():
    """math_react and docvqa: one sandbox process per call, so a batch's calls may overlap (not at rlimit
    without root, where the calls would share one uid's process limit)."""
    import shutil

    from esopt_mp.envs import make
    from esopt_mp.envs.sandbox import Sandbox

    names = ["math_react"] + (["docvqa"] if shutil.which("tesseract") else [])
    for name in names:
        env = make(name)
        assert env.concurrent is (env.sandbox.root or env.sandbox.level != "rlimit"), name
    if not Sandbox().root:
        assert make("math_react", sandbox=Sandbox(level="rlimit")).concurrent is False
