"""The compiled decode of the native backend, above the models and below `generate`.

`decoder` chooses between the whole-step trace and the segmented session and falls back to the
uncompiled loop with the same tokens; `segments` runs a model's own block halves as compiled
segments around the attention; `prefill` compiles the prompt's forward the same way; `rings` plans
the fixed decode buffers the caches lay out; `trace` holds the traced spec shared by all of them.
"""
