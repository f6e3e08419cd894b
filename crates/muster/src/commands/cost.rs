//! `muster cost` and `muster prices`: GPU-hours and what they cost.

use super::{Connection, Failure, print_json, runtime, table};
use clap::Args;

#[derive(Debug, Args)]
pub struct CostArgs {
    /// How far back: a duration (30d, 12h) or `month` (since the 1st, UTC).
    #[arg(long, default_value = "30d")]
    pub since: String,
    /// Group by queue, user, job or pool.
    #[arg(long, default_value = "queue", value_parser = ["queue", "user", "job", "pool"])]
    pub by: String,
    /// Print CSV instead of a table.
    #[arg(long, conflicts_with = "json")]
    pub csv: bool,
    #[command(flatten)]
    pub connection: Connection,
}

/// GPU-hours allocated, used and idle, their cost and waste.
pub fn cost(args: CostArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let report = runtime()?
        .block_on(client.cost(&args.since, &args.by))
        .map_err(anyhow::Error::from)?;
    if args.connection.json {
        print_json(&report)?;
        return Ok(0);
    }
    if args.csv {
        let mut text = format!(
            "{},allocated_gpu_hours,used_gpu_hours,idle_gpu_hours,unmeasured_gpu_hours,cost,\
             waste,unpriced_gpu_hours\n",
            args.by
        );
        for line in &report.lines {
            text.push_str(&format!(
                "{},{:.4},{:.4},{:.4},{:.4},{:.2},{:.2},{:.4}\n",
                csv_field(&line.key),
                line.allocated_gpu_hours,
                line.used_gpu_hours,
                line.idle_gpu_hours,
                line.unmeasured_gpu_hours,
                line.cost,
                line.waste,
                line.unpriced_gpu_hours
            ));
        }
        super::write_bytes(text.as_bytes());
        return Ok(0);
    }
    let header = args.by.to_uppercase();
    let mut rows: Vec<Vec<String>> = report
        .lines
        .iter()
        .map(|line| {
            vec![
                line.key.clone(),
                format!("{:.3}", line.allocated_gpu_hours),
                format!("{:.3}", line.used_gpu_hours),
                format!("{:.3}", line.idle_gpu_hours),
                format!("{:.2}", line.cost),
                format!("{:.2}", line.waste),
            ]
        })
        .collect();
    let sum = |f: fn(&muster_api::protocol::CostLineView) -> f64| -> f64 {
        report.lines.iter().map(f).sum()
    };
    rows.push(vec![
        "TOTAL".to_string(),
        format!("{:.3}", sum(|l| l.allocated_gpu_hours)),
        format!("{:.3}", sum(|l| l.used_gpu_hours)),
        format!("{:.3}", sum(|l| l.idle_gpu_hours)),
        format!("{:.2}", sum(|l| l.cost)),
        format!("{:.2}", sum(|l| l.waste)),
    ]);
    table(
        &[
            header.as_str(),
            "GPU-H ALLOCATED",
            "GPU-H USED",
            "GPU-H IDLE",
            "COST",
            "WASTE (IDLE)",
        ],
        rows,
    );
    if !report.unpriced_models.is_empty() {
        eprintln!(
            "note: no price for {}; their GPU-hours cost 0 here (`muster prices set MODEL PRICE`)",
            report.unpriced_models.join(", ")
        );
    }
    Ok(0)
}

/// A CSV field (RFC 4180): quoted when it holds a comma, quote or line
/// break; a leading `=`, `+`, `-` or `@` is prefixed with `'` so that a
/// spreadsheet does not run it as a formula.
pub(crate) fn csv_field(text: &str) -> String {
    let text = if text.starts_with(['=', '+', '-', '@']) {
        format!("'{text}")
    } else {
        text.to_string()
    };
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn csv_fields_are_quoted_and_formulas_defused() {
        assert_eq!(super::csv_field("team-a"), "team-a");
        assert_eq!(super::csv_field("a,b"), "\"a,b\"");
        assert_eq!(super::csv_field("say \"x\""), "\"say \"\"x\"\"\"");
        assert_eq!(super::csv_field("=cmd()"), "'=cmd()");
    }
}

#[derive(Debug, Args)]
pub struct PricesArgs {
    #[command(subcommand)]
    pub command: Option<PriceCommand>,
    #[command(flatten)]
    pub connection: Connection,
}

#[derive(Debug, clap::Subcommand)]
pub enum PriceCommand {
    /// Set what a GPU-hour of a model costs (admin), e.g. `H100-80GB 2.50`.
    Set { model: String, per_gpu_hour: f64 },
    /// Remove a model's price.
    Remove { model: String },
}

/// List prices, or set or remove one.
pub fn prices(args: PricesArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let rt = runtime()?;
    let list = match &args.command {
        None => rt.block_on(client.prices()),
        Some(PriceCommand::Set {
            model,
            per_gpu_hour,
        }) => rt.block_on(client.set_price(model, *per_gpu_hour)),
        Some(PriceCommand::Remove { model }) => rt.block_on(client.remove_price(model)),
    }
    .map_err(anyhow::Error::from)?;
    if args.connection.json {
        print_json(&list)?;
        return Ok(0);
    }
    table(
        &["GPU MODEL", "PER GPU-HOUR"],
        list.prices
            .iter()
            .map(|(model, price)| vec![model.clone(), format!("{price:.2}")])
            .collect(),
    );
    Ok(0)
}
