"""From files to a model: Hugging Face folders (config.json, safetensors, gpt-oss's MXFP4) and GGUF
files (llama.cpp's names per architecture), quantized weights kept quantized, and tensor-parallel
ranks whose parallel layers each load their own slice (`weight_loader`)."""
