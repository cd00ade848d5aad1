"""Multi-turn rollouts with tools: the settings (settings), the tool interface and its config file
(base), the built-in tools (builtin), tool-call syntaxes (parsers), the concurrent runner (runner)
and the loop (loop). None of these modules imports torch: the engine is passed in."""
