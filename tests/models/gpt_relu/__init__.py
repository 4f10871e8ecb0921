"""The gpt_relu family (docs/extending/model_family.md): GPT with a ReLU MLP. In hpctrain it would be this folder,
hpctrain/models/gpt_relu/, and one line of hpctrain/models/registry.py; tests/models/test_family_guide.py puts it
there for its tests."""
