//! The integration tests, one binary (each test file is a module, so candle and whisper.cpp
//! are linked once). Tests that need the downloaded assets (`scripts/assets/fetch_test_assets.sh`)
//! skip with a message when they are absent, unless `VOICECLONE_REQUIRE_ASSETS=1` (set by the
//! README's test command) makes that a failure. Tests that drive `voiceclone train` through its
//! test seams need `--features test-hooks` and are ignored without it.

mod audio_decode;
mod audio_resample;
mod codec_parity;
mod codes_cli;
mod common;
mod dist_support;
mod embed_cli;
mod export_card;
mod gpu_parity;
mod hub_and_config;
mod model_full_size_load;
mod model_gradients;
mod model_load_errors;
mod model_speaker_parity;
mod model_talker_parity;
mod model_tokenizer_parity;
mod prep_real_speech;
mod prep_rerun_and_bad_input;
mod serve;
mod serve_adapters;
mod serve_errors;
mod serve_lifecycle;
mod serve_page;
mod serve_stream;
mod serve_usage_examples;
mod serve_voices;
mod speak_cli;
mod speak_parity;
mod speak_q4;
mod speakers_cli;
mod speakers_prep_embed;
mod train_cli;
mod train_dist;
mod train_dist_failures;
mod train_hybrid;
mod train_launchers;
mod train_lora;
mod train_memory;
mod train_parity;
mod train_plan;
mod train_recovery;
mod train_samples;
mod train_samples_select;
mod train_support;
mod train_tensorboard;
mod train_validation;
