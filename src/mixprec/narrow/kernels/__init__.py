"""How narrow code runs as GPU kernels: hand-written Triton kernels (the block-wise cast, the grouped block-wise
GEMMs: each a module that imports Triton at its top and lists its launches) and the functions CUDA runs compiled
by Inductor (cuda_compiled). Nothing here imports the layers above."""
