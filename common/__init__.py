"""The outer layer shared by every stage: text, protocols, model files."""
