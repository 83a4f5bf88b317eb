"""Multi-turn episodes for PPO/GRPO: an environment (``environment.name_or_path``) and / or tools
(``environment.tools``) answer the policy's turns, and the episode's tokens are exactly the tokens sampled plus the
rendered messages in between (``action_mask`` tells them apart).

Modules: ``parsers`` (tool-call formats, a registry), ``tools`` (loading, checking and running tool calls),
``sandbox`` (tool calls in limited child processes), ``timeouts``, ``specs`` (``package.module:Name``), ``chat``
(the chat template: the prompt with the tools, the tokens of each new message), ``environments`` (building and
calling the user's environment, its answers checked), ``episode`` (one episode's tokens, mask, rewards and record),
``runner`` (the batched turn loop). Kept light: the sandbox's child process imports this package.
"""
