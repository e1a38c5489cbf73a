//! Bad input (issue 7, item 4): every flag and environment value lens-probe reads gives
//! one clear line naming the key and the valid values, exit 2; the event decoder and the
//! spec parsers are fuzzed (proptest) in the suite.
