output "inventory" {
  description = "The Ansible inventory (INI) in the layout of inventory.example.ini; write it to a file with `llmctl infra inventory`."
  value       = try(terraform_data.this.output, null)
}

output "inventory_data" {
  description = "The same inventory as structured data (groups, members, host addresses) for other modules."
  value       = try(local.inventory_data, null)
}

output "hosts" {
  description = "Host name to address."
  value       = try({ for h in var.hosts : h.name => h.address }, null)
}
