"""Multi-turn environments: the contract and what is built on it.

base.py        the contract (Observation, Environment)
loader.py      load_environment_factory(spec): the factory a config names, and its identity for cache keys
checked.py     CheckedEnvironment: every call held to the contract; failures name environment, row and turn
tools.py       SandboxedTool: a tool call in a worker with a timeout, a memory cap and no network
tool_env.py    ToolCallingEnvironment: the policy calls tools as <tag>argument</tag>, then answers
calculator.py  the calculator tool;  arithmetic.py  CalculatorArithmetic, a task won by calling it
digit_echo.py  DigitEcho, a multi-turn task the tiny model learns
guess_number.py  GuessTheNumber, higher / lower feedback, for a small pretrained model
datasets.py    the built-in tasks' .jsonl writer
skyrl.py       SkyRLGymEnvironment: SkyRL-Gym's environments (skyrl-gym) behind the contract
"""
