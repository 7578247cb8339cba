"""WebArena-Lite through BrowserGym (``env=webarena_lite``): config, offline stack, actions, observations, tasks."""
