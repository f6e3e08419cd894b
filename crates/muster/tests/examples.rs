//! Every example job spec in examples/jobs parses.

#[test]
fn example_job_specs_are_valid() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/jobs");
    let mut count = 0;
    for entry in std::fs::read_dir(dir).expect("examples/jobs exists") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read_to_string(&path).expect("readable");
            if let Err(errors) = muster_api::parse_job_spec_yaml(&text) {
                panic!("{}: {errors}", path.display());
            }
            count += 1;
        }
    }
    assert!(count >= 3);
}
