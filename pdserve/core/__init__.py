"""Pure-Python scheduling core: requests, KV block manager, scheduler.

Nothing here imports torch: the same code drives the real engine and the simulator.
"""
