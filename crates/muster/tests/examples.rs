//! Every example job spec in examples/jobs, and service spec in
//! examples/services, parses.

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

#[test]
fn example_service_specs_are_valid() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/services");
    let mut count = 0;
    for entry in std::fs::read_dir(dir).expect("examples/services exists") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read_to_string(&path).expect("readable");
            if let Err(errors) = muster_api::service::parse_service_spec_yaml(&text) {
                panic!("{}: {errors}", path.display());
            }
            count += 1;
        }
    }
    assert!(count >= 1);
}
