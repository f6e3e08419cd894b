//! The price list: what a GPU-hour of each model costs, for `muster cost`
//! and queue budgets. A YAML (or JSON) map from GPU model to price:
//!
//! ```yaml
//! H100-80GB: 2.50
//! A100-80GB: 1.60
//! ```

use std::collections::BTreeMap;

/// The most models a price list names.
pub const MAX_PRICED_MODELS: usize = 1_000;

/// Checks a GPU model's name as prices are kept.
pub fn check_model(model: &str) -> Result<(), String> {
    let mut chars = model.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphanumeric());
    if !first_ok
        || model.len() > 128
        || !model
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._()-".contains(c))
    {
        return Err(format!(
            "a GPU model is 1 to 128 letters, digits, '.', '_', '(', ')' or '-', starting with a \
             letter or digit (as agents name it, e.g. H100-80GB); got {model:?}"
        ));
    }
    Ok(())
}

/// Checks one price: a finite number from 0 to 1,000,000 per GPU-hour.
pub fn check_price(model: &str, price: f64) -> Result<(), String> {
    check_model(model)?;
    if !price.is_finite() || !(0.0..=1_000_000.0).contains(&price) {
        return Err(format!(
            "the price of {model} must be a number from 0 to 1000000 per GPU-hour, got {price}"
        ));
    }
    Ok(())
}

/// The model as prices are kept: as agents name it (upper case, trimmed).
pub fn price_key(model: &str) -> String {
    muster_model::GpuModel::new(model).as_str().to_string()
}

/// Reads a price list file's text; every problem is named.
pub fn parse_price_list(text: &str) -> Result<BTreeMap<String, f64>, String> {
    let value = crate::parse::yaml_value(text).map_err(|errors| errors.to_string())?;
    let serde_json::Value::Object(map) = value else {
        return Err(
            "a price list is a map from GPU model to price per GPU-hour, like `H100-80GB: 2.50`"
                .to_string(),
        );
    };
    if map.len() > MAX_PRICED_MODELS {
        return Err(format!(
            "a price list names at most {MAX_PRICED_MODELS} models, this one {}",
            map.len()
        ));
    }
    let mut prices = BTreeMap::new();
    let mut problems = Vec::new();
    for (model, value) in map {
        match value.as_f64() {
            Some(price) => match check_price(&model, price) {
                Ok(()) => {
                    prices.insert(price_key(&model), price);
                }
                Err(problem) => problems.push(problem),
            },
            None => problems.push(format!(
                "the price of {model} must be a number per GPU-hour, got {value}"
            )),
        }
    }
    if problems.is_empty() {
        Ok(prices)
    } else {
        Err(problems.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_price_list_reads_and_every_bad_price_is_named() {
        let prices = parse_price_list("H100-80GB: 2.50\na100-80gb: 2\n").expect("valid");
        assert_eq!(prices["H100-80GB"], 2.5);
        assert_eq!(prices["A100-80GB"], 2.0);
        let error = parse_price_list("H100: -1\nL4: cheap\n").expect_err("invalid");
        assert!(error.contains("H100") && error.contains("L4"), "{error}");
        assert!(parse_price_list("- 1\n- 2\n").is_err());
        assert!(check_price("H100", f64::NAN).is_err());
    }
}
