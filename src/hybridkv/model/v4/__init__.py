"""DeepSeek-V4 (sliding window + compressed sparse / heavily compressed attention) in pure
torch, with prefix-closed compressed entries and an explicit boundary state (DESIGN §12)."""
