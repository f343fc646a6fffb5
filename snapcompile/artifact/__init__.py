"""An artifact folder and everything that writes or reads it.

- manifest: manifest.json (model, shapes, policy, graphs, file table) and its validation
- naming: which graphs an artifact of given shapes and policy holds, and their names
- files: each file's size and sha256, recorded and checked
- onnx_io: graphs saved with one shared weights.bin, loaded back and matched to the manifest
- footprint: the memory an artifact needs to run, from its manifest alone
"""
