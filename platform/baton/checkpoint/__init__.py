from baton.checkpoint.store import CheckpointStore, filter_optim_state, merge_optim_states

__all__ = ["CheckpointStore", "filter_optim_state", "merge_optim_states"]
