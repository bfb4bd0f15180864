"""What reads run folders, above both training and the weight formats: what a path names (a
run folder, a checkpoint, a Hugging Face folder) and the model it holds (resolve), a run's
weights as a Hugging Face folder (export), and what a model writes (generate)."""
