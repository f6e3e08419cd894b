//! muster's wire types: the job spec as users write it (YAML or JSON), and its
//! validation into `muster-model` types.
