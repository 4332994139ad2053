"""The frozen target: where its weights come from (path, embedded), how it loads (model), how it is
split over GPUs (tensor_parallel), and the caches and attention windows its decoders use."""
