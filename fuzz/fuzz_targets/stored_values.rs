//! One value of `durable.redb`: the first byte picks the table
//! (`presence_server::fuzzing::STORED_TABLES`), the rest is the stored value.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some((&table, value)) = data.split_first() {
        presence_server::fuzzing::stored_value(table, value);
    }
});
